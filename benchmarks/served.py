"""Served truth, tabulated: every run of a study that llama.cpp served (`evaluate.serve`, `evaluate --engine`),
the harness's decoder beside the engine per prompt set, how their cycles agreed, the lossless flips and the
speed with and without the draft. Reads only what the runs recorded: `python -m benchmarks.served --workdir work
--study default` writes benchmarks/SERVED.md."""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime
from pathlib import Path

from harness import tracking
from harness.run import SERVED_RECORDS_FILE
from harness.served import accepted_length

OUT = Path(__file__).parent / "SERVED.md"


def per_set(records: list[dict], key: str) -> dict[str, str]:
    """Mean over requests of each request's tokens per cycle, and the accepted drafts and cycles it counts."""
    found = {}
    for name in sorted({r["set"] for r in records}):
        rows = [r[key] for r in records if r["set"] == name and r[key]]
        mean = sum(accepted_length(a) for a in rows) / len(rows) if rows else float("nan")
        found[name] = f"{mean:.3f} ({sum(map(sum, rows))} accepted in {sum(map(len, rows))} cycles)"
    return found


def rows(workdir: Path, study: str) -> list[list[str]]:
    client = tracking.client(workdir)
    experiment = client.get_experiment_by_name(tracking.experiment_name(study))
    if experiment is None:
        raise SystemExit(f"error: no study named {study!r} in {workdir}")
    table = []
    for run in client.search_runs([experiment.experiment_id]):
        served = tracking.under_prefix(run.data.metrics, tracking.SERVED_PREFIX)
        if "agreement_cycle_fraction" not in served:
            continue
        records = json.loads((Path(run.data.tags[tracking.TAG_RUN_DIR]) / SERVED_RECORDS_FILE).read_text())
        ours, theirs = per_set(records, "harness_accepted"), per_set(records, "served_accepted")
        for name in ours:
            table.append(
                [
                    f"`{run.info.run_name}`",
                    name,
                    ours[name],
                    theirs[name],
                    f"{served['agreement_cycle_fraction']:.3f} of {int(served['cycles_compared'])}",
                    f"{served['agreement_request_fraction']:.3f}",
                    f"{int(served['lossless_flips_vs_engine'])} / {int(served['lossless_flips_vs_harness'])}",
                    f"{served['tokens_per_s_draft']:.2f} / {served['tokens_per_s_alone']:.2f}",
                ]
            )
    return table


def markdown(studies: list[tuple[Path, str]], note: str = "") -> str:
    headers = [
        "run",
        "prompts",
        "harness decoder T=0",
        "llama.cpp T=0",
        "cycles agreeing",
        "requests agreeing",
        "flips (vs engine alone / vs harness)",
        "tokens/s with / without draft",
    ]
    lines = []
    for workdir, study in studies:
        lines += ["", f"## Study `{study}`", ""]
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows(workdir, study)]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(f"--study {workdir}:{study}" for workdir, study in studies)
    return "\n".join(
        [
            "# Served truth: llama.cpp against the harness",
            "",
            f"Tabulated {when} by `python -m benchmarks.served {command}` from what the runs recorded "
            f"(machine: {platform.machine()}, {platform.processor() or 'CPU'}). Per run and prompt set: the mean "
            "over requests of tokens per verify cycle (1 + accepted drafts / cycles, the verified token included) "
            "for the harness's own decoder and for llama.cpp on the same prompts at T = 0, with the counts behind "
            "it; the fraction of cycles (among those in which both drafted the whole block) and of requests in "
            "which the two accepted the same count; requests whose served tokens differ from the engine without "
            "the draft and from the harness's greedy reference; and served tokens per second with and without the "
            "draft on the machine that served them." + (f" {note}" if note else ""),
            *lines,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--study",
        action="append",
        metavar="WORKDIR:STUDY",
        help="a study and the work directory that holds it (repeatable; default: work:default)",
    )
    parser.add_argument("--note", default="", help="what the table cannot say (the machine's load, say)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    studies = [(Path(w), s) for w, _, s in (item.rpartition(":") for item in args.study or ["work:default"])]
    args.out.write_text(markdown(studies, args.note))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
