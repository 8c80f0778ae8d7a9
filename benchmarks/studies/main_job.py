"""The main job on a fresh clone, recorded from its log: wall time, what it computed in, its verdict lines and where
its served runs stand.

    rm -rf /tmp/mj-clone && git clone -q . /tmp/mj-clone && cd /tmp/mj-clone && /usr/bin/time -v bash -c \
        "bash scripts/setup.sh && .venv/bin/dflash-lab study launch studies/default.yaml --n-jobs auto" \
        > /tmp/mj.log 2>&1
    python -m benchmarks.studies.main_job --log /tmp/mj.log --clone /tmp/mj-clone --note "llama.cpp cached"

The record goes into benchmarks/studies/MAIN_JOB.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, machine_kind, page_argument
from benchmarks.project.ci_time import WALL

GROUP, PAGE = "studies", "MAIN_JOB"
REPORT = Path("work") / "reports" / "default" / "README.md"
COMPUTED_IN = re.compile(r"\*\*Computed in:\*\* ([^.]+)\.")
STANDING = re.compile(r"\*\*Against the break-even\.\*\* (.+)")
# The report's served runs beside llama.cpp's n-gram types (reports/sections.py, ngram_table): its lead and table.
NGRAM_TABLE = re.compile(r"\*\*Beside llama\.cpp's training-free speculation\.\*\*.*?\n\n(?:\|.*(?:\n|$))+")


def verdict_lines(log: str) -> list[str]:
    """The lines the launch ended on, after `Verdicts of study ...:`."""
    lines = log.replace("\r", "\n").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Verdicts of study")), None)
    if start is None:
        raise SystemExit("error: invalid --log: no `Verdicts of study` line in it; allowed a finished main job's log")
    return [line for line in lines[start + 1 :] if line.startswith("- ")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=Path, required=True, help="the launch's output under `/usr/bin/time -v`")
    parser.add_argument("--clone", type=Path, required=True, help="the fresh clone it ran in (its commit, its report)")
    parser.add_argument("--note", default="", help="what the numbers cannot say (a cached build, other load)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    if not args.log.is_file():
        raise SystemExit(f"error: invalid --log={args.log}: no such file; allowed a saved main-job log")
    log = args.log.read_text(errors="replace")
    wall, verdicts = WALL.search(log), verdict_lines(log)
    report = (args.clone / REPORT).read_text()
    computed = COMPUTED_IN.search(report)
    standing = STANDING.search(report)
    head = subprocess.run(["git", "-C", str(args.clone), "rev-parse", "--short=9", "HEAD"], capture_output=True)
    commit = head.stdout.decode().strip() or None
    clock = wall["wall"].split(".")[0] if wall else "not measured"
    machine = machine_kind()
    row = [clock, computed.group(1) if computed else "not recorded", args.note]
    blocks = [
        Table(["wall, setup included", "computed in", "note"], [row]),
        "```text\nVerdicts of study default:\n" + "\n".join(verdicts) + "\n```",
        *([standing.group(1)] if standing else []),
        *([ngram.group(0).strip()] if (ngram := NGRAM_TABLE.search(report)) else []),
    ]
    values = {"wall": clock, "commit": commit, "verdicts": verdicts}
    record = Record(f"Fresh clone at {commit} on {machine}", blocks, values, Provenance.now())
    page = Page.named(GROUP, args.page or PAGE)
    print(f"recorded {page.add(record)}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
