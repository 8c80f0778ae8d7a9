"""Served truth, tabulated: every run of a study that llama.cpp served (`evaluate.serve`, `evaluate --engine`),
the harness's decoder beside the engine per prompt set, how their cycles agreed, the lossless flips and the
speed with and without the draft. Reads only what the runs recorded: `python -m benchmarks.serving.served --workdir work
--study default` records in benchmarks/serving/SERVED.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness import tracking
from harness.run import SERVED_RECORDS_FILE
from harness.serving import metrics as served_names
from harness.serving.compare import accepted_length

GROUP, PAGE = "serving", "SERVED"


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
        served = tracking.under_prefix(run.data.metrics, served_names.PREFIX)
        if served_names.AGREEMENT_CYCLES not in served:
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
                    f"{served[served_names.AGREEMENT_CYCLES]:.3f} of {int(served[served_names.CYCLES_COMPARED])}",
                    f"{served[served_names.AGREEMENT_REQUESTS]:.3f}",
                    f"{int(served[served_names.FLIPS_VS_ENGINE])} / {int(served[served_names.FLIPS_VS_HARNESS])}",
                    f"{served[served_names.TOKENS_PER_S_DRAFT]:.2f} / {served[served_names.TOKENS_PER_S_ALONE]:.2f}",
                ]
            )
    return table


def record(studies: list[tuple[Path, str]], note: str = "") -> Record:
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
    about = (
        "Tabulated from what the runs recorded. Per run and prompt set: the mean over requests of tokens per verify "
        "cycle (1 + accepted drafts / cycles, the verified token included) for the harness's own decoder and for "
        "llama.cpp on the same prompts at T = 0, with the counts behind it; the fraction of cycles (among those in "
        "which both drafted the whole block) and of requests in which the two accepted the same count; requests "
        "whose served tokens differ from the engine without the draft and from the harness's greedy reference; and "
        "served tokens per second with and without the draft on the machine that served them."
        + (f" {note}" if note else "")
    )
    blocks: list = [about]
    for workdir, study in studies:
        blocks += [f"**Study `{study}`** (`{workdir}`)", Table(headers, rows(workdir, study))]
    return Record(f"Studies {', '.join(study for _, study in studies)}", blocks, provenance=Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--study",
        action="append",
        metavar="WORKDIR:STUDY",
        help="a study and the work directory that holds it (repeatable; default: work:default)",
    )
    parser.add_argument("--note", default="", help="what the table cannot say (the machine's load, say)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    studies = [(Path(w), s) for w, _, s in (item.rpartition(":") for item in args.study or ["work:default"])]
    page = Page.named(GROUP, args.page or PAGE)
    written = page.add(record(studies, args.note))
    print(f"recorded {written}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
