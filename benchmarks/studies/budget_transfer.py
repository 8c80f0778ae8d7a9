"""Budget transfer, tabulated: the default design's verdicts at 60 steps against the same knobs at 240, from a
launch of studies/budget-transfer.yaml. Reads only what the runs recorded, through the report's own sections:
`python -m benchmarks.studies.budget_transfer --workdir work-transfer` adds a record to
benchmarks/studies/BUDGET_TRANSFER.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, page_argument
from reports.analysis import analyse, at_budget, recorded_budgets, recorded_design
from reports.collect import StudyRecord, collect
from reports.designed import effects_section, transfer_section
from reports.effects import ARM
from reports.sections import computed_in

STUDY = "budget-transfer"


GROUP = "studies"


def default_page(study: str) -> str:
    """Each study's own page (budget-transfer-full -> BUDGET_TRANSFER_FULL), so neither overwrites the other."""
    return study.upper().replace("-", "_")


def wall_minutes(record: StudyRecord) -> dict[int, float]:
    """Run wall time per budget, summed over runs (two workers run two at a time)."""
    return {steps: float(at_budget(record, steps).runs["wall_s"].sum()) / 60 for steps in recorded_budgets(record)}


def summary(labels: dict[str, str]) -> list[str]:
    """The transfer labels grouped: which verdicts held, shrank, appeared... at each longer budget."""
    lines = []
    for key in dict.fromkeys(k.partition("/")[0] for k in labels):
        by_label: dict[str, list[str]] = {}
        for term_key, found in labels.items():
            steps, _, term = term_key.partition("/")
            if steps == key:
                by_label.setdefault(found, []).append("DFlash2 − DFlash" if term == ARM else f"`{term}`")
        groups = "; ".join(f"*{found}*: {', '.join(terms)}" for found, terms in by_label.items())
        lines.append(f"- **At {key} steps:** {groups}.")
    return lines


def longer_points(record: StudyRecord) -> str:
    """What the longer budget ran: the same design, or a fraction of it."""
    recorded = recorded_design(record)
    same = recorded.longer.describe() == recorded.design.describe()
    return ("the same " if same else "a ") + recorded.longer.describe()


def record(study: StudyRecord, launch_wall: str, note: str) -> Record:
    first = recorded_budgets(study)[0]
    analysis = analyse(study)
    effects, _ = effects_section(analysis, f", at {first} steps")
    transfer, _ = transfer_section(analysis)
    labels = analysis.design.transfer_labels() if analysis.design else {}
    walls = ", ".join(f"{steps} steps: {minutes:.1f} min" for steps, minutes in wall_minutes(study).items())
    about = (
        f"From a launch of `studies/{study.name}.yaml` (`dflash-lab study launch studies/{study.name}.yaml --n-jobs "
        "auto`): the main job's design and seeds at 60 steps, then the same five knobs trained from the start for "
        f"240 steps (4x, with the linear decay stretched to 240) on {longer_points(study)}, and DFlash at seeds 0, 1 "
        "and 2 at both budgets."
    )
    facts = [
        f"- **Computed in** {computed_in(study.runs)}.",
        f"- **Wall time:** {launch_wall} for the whole launch (2 workers); run wall time summed over runs: {walls}.",
        *([f"- **Note:** {note}"] if note else []),
        *summary(labels),
    ]
    blocks = [
        about,
        "\n".join(facts),
        transfer.replace("### ", "#### Budgets ").replace("## Budget transfer", "### The transfer")
        if transfer
        else "No longer budget was recorded.",
        *([effects.replace("## Designed effects", f"### The {first}-step fit in full")] if effects else []),
    ]
    return Record(f"Study `{study.name}`", blocks, {"labels": labels}, Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="where the study was launched")
    parser.add_argument("--study", default=STUDY, help="budget-transfer, or budget-transfer-full (the whole design)")
    parser.add_argument("--wall", default="not measured", help="the launch's wall time, as /usr/bin/time gave it")
    parser.add_argument("--note", default="", help="what the tables cannot say (the machine's load, say)")
    page_argument(parser, GROUP, "<STUDY>, upper case")
    args = parser.parse_args(argv)
    page = Page.named(GROUP, args.page or default_page(args.study))
    written = page.add(record(collect(args.study, args.workdir), args.wall, args.note))
    print(f"recorded {written}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
