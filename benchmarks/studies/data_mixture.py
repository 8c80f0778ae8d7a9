"""The data-mixture study (studies/data-mixture.yaml), recorded from its tracking store: which training data drafts
best on the same held-out conversations (half ShareGPT, half chit-chat), offline, with training noise inside each
interval; how many training prompts each mixture lost to MT-bench decontamination; what training cost; whether the
runs were still improving at their budget.

    dflash-lab study launch studies/data-mixture.yaml --workdir work
    python -m benchmarks.studies.data_mixture --workdir work --note "nothing else running"

The record goes into benchmarks/studies/DATA_MIXTURE.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping
from pathlib import Path

from algorithms.metrics import ORACLE_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH
from benchmarks.common.records import Page, Provenance, Record, Table, machine_kind, page_argument
from harness import tracking
from harness.uncertainty import mean_estimate
from reports.analysis import analyse
from reports.collect import StudyRecord, collect
from reports.designed import last_part_gain
from reports.estimates import difference, estimate

GROUP, PAGE, STUDY = "studies", "DATA_MIXTURE", "data-mixture"
DECONTAMINATED = "decontaminated_conversations"  # the param harness/train.py logs with every run


def measure(args: argparse.Namespace) -> Record:
    record, client = collect(args.study, args.workdir), tracking.client(args.workdir)
    dropped = {run_id: client.get_run(run_id).data.params.get(DECONTAMINATED, "") for run_id in record.runs["run_id"]}
    return mixture_record(record, dropped, args.note)


def mixture_record(record: StudyRecord, dropped: Mapping[str, str], note: str = "") -> Record:
    """The record of a finished mixture study; `dropped` maps each run id to its decontamination count."""
    trials = [c for c in analyse(record).configs if c.first["role"] == tracking.ROLE_TRIAL]
    if len(trials) < 2:
        raise SystemExit(
            f"error: invalid --study={record.name!r}: {len(trials)} finished trial(s); allowed two or more"
        )
    best = max(trials, key=lambda c: estimate(c, REALIZED_ACCEPTED_LENGTH).value)
    rows, values, gains = [], {}, []
    for config in sorted(trials, key=lambda c: -estimate(c, REALIZED_ACCEPTED_LENGTH).value):
        runs = config.runs
        late = [last_part_gain(record.curves[run_id]) for run_id in runs["run_id"] if run_id in record.curves]
        late = [found[0].value for found in late if found is not None]
        gains += late
        versus = "best" if config is best else difference(config, REALIZED_ACCEPTED_LENGTH, best).text(signed=True)
        counts = sorted({dropped.get(run_id, "") for run_id in runs["run_id"]})
        found = {
            m: estimate(config, m) for m in (UNARY_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, ORACLE_ACCEPTED_LENGTH)
        }
        minutes = statistics.fmean(runs["wall_s"]) / 60
        rows.append(
            [
                f"`{config.first['dataset']}`",
                len(config.seeds),
                *[found[m].text() for m in found],
                versus,
                ", ".join(c for c in counts if c) or "not recorded",
                f"{statistics.fmean(late):+.3f}" if late else "not recorded",
                f"{minutes:.1f}",
            ]
        )
        values[config.first["dataset"]] = {
            **{m: [e.value, e.low, e.high] for m, e in found.items()},
            "seeds": len(config.seeds),
            "last_third_gain": late,
            "training_min": minutes,
        }
    steps = int(best.first["max_steps"])
    mean_gain = mean_estimate(gains) if len(gains) > 1 else None
    improving = mean_gain is not None and mean_gain.low > 0
    budget = (
        f"At {steps} steps per run the runs were **still improving** (mean gain over the last third "
        f"{mean_gain.text(signed=True)} over {len(gains)} runs): the ranking is about {steps}-step drafts, not "
        "converged ones."
        if improving
        else f"No gain over the last third is resolved at {steps} steps (a decaying learning rate flattens it either "
        f"way), so this is a ranking of {steps}-step drafts, not a statement about converged ones."
    )
    about = (
        f"`{record.name}`: block-4 DFlash2, each mixture's own regenerated documents and features, {len(best.seeds)} "
        "training seeds per mixture, all validated on the same held-out conversations (`validation_data`, never "
        "trained on). Accepted lengths include the verified anchor; each interval holds anchor noise (clustered by "
        "document) and the spread over seeds (training noise), and *− best* is the difference with the best "
        "mixture, paired by document and seed. *Dropped*: training conversations "
        f"removed by MT-bench decontamination. {budget} Offline acceptance, not served speed."
        + (f" Note: {note}." if note else "")
    )
    columns = ["dataset", "seeds", "unary", "realized", "oracle", "realized − best", "dropped", "last-third gain"]
    table = Table([*columns, "training (min per run)"], rows)
    return Record(f"`{record.name}` on {machine_kind()}", [about, table], values, Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="the study's work directory")
    parser.add_argument("--study", default=STUDY, help=f"the study's name (default: {STUDY})")
    parser.add_argument("--note", default="", help="what the numbers cannot say (other load on the machine)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    found = measure(args)
    page = Page.named(GROUP, args.page or PAGE).titled("Which training data drafts best: the data-mixture study")
    page.publish(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
