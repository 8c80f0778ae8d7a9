"""How long `.ci/run` takes on a clean clone: one record per measured run, read from its log.

    rm -rf /tmp/ci-clone && git clone -q . /tmp/ci-clone && cd /tmp/ci-clone \
        && CI=true /usr/bin/time -v bash .ci/run > /tmp/ci.log 2>&1         # docs-test: skip (a 30-minute run)
    python -m benchmarks.project.ci_time --log /tmp/ci.log --clone /tmp/ci-clone --note "llama.cpp cached"

The wall time and peak memory come from `/usr/bin/time -v`, the test counts and pytest's own time from pytest's
closing line; the record goes into benchmarks/project/CI_TIME.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, machine_kind, page_argument

GROUP, PAGE = "project", "CI_TIME"
WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?P<wall>[\d:.]+)")
PEAK = re.compile(r"Maximum resident set size \(kbytes\): (?P<kb>\d+)")
SUMMARY = re.compile(r"=+ (?P<counts>(?:\d+ \w+(?:, )?)+).* in (?P<seconds>[\d.]+)s")


def measured(log: str) -> dict:
    """What one `.ci/run` log says: wall time (m:ss), peak RSS, pytest's counts and seconds."""
    wall, summaries = WALL.search(log), SUMMARY.findall(log)
    if wall is None or not summaries:
        raise SystemExit(
            "error: invalid --log: no `/usr/bin/time -v` wall time or no pytest closing line in it; allowed the "
            "output of `/usr/bin/time -v bash .ci/run`"
        )
    counts, seconds = summaries[-1]
    peak = PEAK.search(log)
    clock = wall["wall"].split(".")[0]
    return {
        "wall": clock,
        "wall_s": sum(int(part) * 60**i for i, part in enumerate(reversed(clock.split(":")))),
        "pytest_s": float(seconds),
        "result": counts.strip().rstrip(","),
        "peak_rss_gb": int(peak["kb"]) / 1e6 if peak else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=Path, required=True, help="the output of `/usr/bin/time -v bash .ci/run`")
    parser.add_argument("--clone", type=Path, default=Path("."), help="the clone that ran (its commit is recorded)")
    parser.add_argument("--note", default="", help="what the numbers cannot say (a cached build, the machine's load)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    if not args.log.is_file():
        raise SystemExit(f"error: invalid --log={args.log}: no such file; allowed a saved .ci/run log")
    found = measured(args.log.read_text(errors="replace"))
    head = subprocess.run(["git", "-C", str(args.clone), "rev-parse", "--short=9", "HEAD"], capture_output=True)
    found["commit"] = head.stdout.decode().strip() or None
    machine = machine_kind()
    peak = f"{found['peak_rss_gb']:.1f} GB" if found["peak_rss_gb"] else "not measured"
    row = [found["wall"], f"{found['pytest_s']:.0f} s", found["result"], peak, args.note]
    columns = ["wall", "pytest", "result", "peak RSS", "note"]
    record = Record(f"Clean clone at {found['commit']} on {machine}", [Table(columns, [row])], found, Provenance.now())
    page = Page.named(GROUP, args.page or PAGE)
    print(f"recorded {page.add(record)}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
