"""Budget transfer, tabulated: the default design's verdicts at 60 steps against the same knobs at 240, from a
launch of studies/budget-transfer.yaml. Reads only what the runs recorded, through the report's own sections:
`python -m benchmarks.budget_transfer --workdir work-transfer` writes benchmarks/BUDGET_TRANSFER.md."""

from __future__ import annotations

import argparse
import platform
from datetime import UTC, datetime
from pathlib import Path

from reports.analysis import analyse, at_budget, recorded_budgets, recorded_design
from reports.collect import StudyRecord, collect
from reports.designed import effects_section, transfer_section
from reports.effects import ARM
from reports.render import computed_in

STUDY = "budget-transfer"


def default_out(study: str) -> Path:
    """Each study's own file (budget-transfer-full -> BUDGET_TRANSFER_FULL.md), so neither overwrites the other."""
    return Path(__file__).parent / f"{study.upper().replace('-', '_')}.md"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "CPU"


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


def markdown(record: StudyRecord, launch_wall: str, note: str) -> str:
    first = recorded_budgets(record)[0]
    analysis = analyse(record)
    effects, _ = effects_section(analysis, f", at {first} steps")
    transfer, _, labels = transfer_section(analysis)
    walls = ", ".join(f"{steps} steps: {minutes:.1f} min" for steps, minutes in wall_minutes(record).items())
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# Budget transfer: do the main job's 60-step verdicts hold at 240 steps?",
            "",
            f"Tabulated {when} by `python -m benchmarks.budget_transfer` from a launch of "
            f"`studies/{record.name}.yaml` (`dflash-lab study launch studies/{record.name}.yaml --n-jobs auto`): "
            "the main job's design and seeds at 60 steps, then the same five knobs trained from the start for 240 "
            f"steps (4x, with the linear decay stretched to 240) on {longer_points(record)}, and DFlash at "
            "seeds 0, 1 and 2 at both budgets.",
            "",
            f"- **Machine:** {cpu_model()}, {platform.machine()}, 2 cores; computed in {computed_in(record.runs)}.",
            f"- **Wall time:** {launch_wall} for the whole launch (2 workers); run wall time summed over runs: "
            f"{walls}.",
            *([f"- **Note:** {note}"] if note else []),
            *summary(labels),
            "",
            transfer.replace("## Budget transfer", "## The transfer").replace("### ", "### Budgets ")
            if transfer
            else "No longer budget was recorded.",
            "",
            effects.replace("## Designed effects", f"## The {first}-step fit in full") if effects else "",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="where the study was launched")
    parser.add_argument("--study", default=STUDY, help="budget-transfer, or budget-transfer-full (the whole design)")
    parser.add_argument("--wall", default="not measured", help="the launch's wall time, as /usr/bin/time gave it")
    parser.add_argument("--note", default="", help="what the tables cannot say (the machine's load, say)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/<STUDY>.md, upper case")
    args = parser.parse_args(argv)
    out = args.out or default_out(args.study)
    out.write_text(markdown(collect(args.study, args.workdir), args.wall, args.note))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
