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
import dataclasses
import statistics
from collections.abc import Mapping
from pathlib import Path

from algorithms.metrics import ORACLE_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH
from benchmarks.common.records import Page, Provenance, Record, Table, machine_kind, page_argument
from harness import tracking
from harness.data import validation_sources
from harness.validation import DOCUMENT_COLUMN
from reports.analysis import analyse
from reports.collect import StudyRecord, collect
from reports.designed import late_gains
from reports.estimates import Configuration, difference, estimate

GROUP, PAGE, STUDY = "studies", "DATA_MIXTURE", "data-mixture"
# The params harness/train.py logs with every run
DECONTAMINATED, VALIDATION_DATA, NUM_VALIDATION = (
    "decontaminated_conversations",
    "data.validation_data",
    "data.num_validation",
)


def measure(args: argparse.Namespace) -> Record:
    record, client = collect(args.study, args.workdir), tracking.client(args.workdir)
    params = {run_id: client.get_run(run_id).data.params for run_id in record.runs["run_id"]}
    dropped = {run_id: found.get(DECONTAMINATED, "") for run_id, found in params.items()}
    sources = {
        run_id: validation_sources(found[VALIDATION_DATA], int(found[NUM_VALIDATION]))
        for run_id, found in params.items()
        if found.get(VALIDATION_DATA, "None") != "None"
    }
    return mixture_record(record, dropped, sources, args.note)


def by_source(config: Configuration, sources: Mapping[str, list[str]], source: str) -> Configuration | None:
    """The configuration's validation documents of one source (None where a run's documents do not line up with
    its sources, so that which document came from where is not known)."""
    documents = {}
    for seed, run_id in zip(config.runs["seed"].astype(str), config.runs["run_id"], strict=True):
        frame, labels = config.documents.get(seed), sources.get(run_id)
        if frame is None or labels is None or len(frame) != len(labels):
            return None
        documents[seed] = frame[[labels[i] == source for i in frame[DOCUMENT_COLUMN]]]
    return dataclasses.replace(config, documents=documents)


def source_table(trials: list[Configuration], sources: Mapping[str, list[str]]) -> tuple[Table | None, dict]:
    """Each mixture's realized acceptance on each validation source alone, and its difference with the best mixture
    on that source (paired by document and seed)."""
    names = list(dict.fromkeys(label for labels in sources.values() for label in labels))
    split = {source: [by_source(c, sources, source) for c in trials] for source in names}
    if not names or any(part is None for parts in split.values() for part in parts):
        return None, {}
    columns, values = ["dataset"], {}
    for source in names:
        columns += [f"realized on {source}", f"− best on {source}"]
    cells = {c.key: [f"`{c.first['dataset']}`"] for c in trials}
    for source, parts in split.items():
        best = max(parts, key=lambda part: estimate(part, REALIZED_ACCEPTED_LENGTH).value)
        for config, part in zip(trials, parts, strict=True):
            found = estimate(part, REALIZED_ACCEPTED_LENGTH)
            versus = "best" if part is best else difference(part, REALIZED_ACCEPTED_LENGTH, best).text(signed=True)
            cells[config.key] += [found.text(), versus]
            values.setdefault(config.first["dataset"], {})[source] = [found.value, found.low, found.high]
    return Table(columns, list(cells.values())), values


def mixture_record(
    record: StudyRecord, dropped: Mapping[str, str], sources: Mapping[str, list[str]], note: str = ""
) -> Record:
    """The record of a finished mixture study; `dropped` maps each run id to its decontamination count, `sources`
    to the source of each of its validation documents."""
    trials = [c for c in analyse(record).configs if c.first["role"] == tracking.ROLE_TRIAL]
    if len(trials) < 2:
        raise SystemExit(
            f"error: invalid --study={record.name!r}: {len(trials)} finished trial(s); allowed two or more"
        )
    ranked = sorted(trials, key=lambda c: -estimate(c, REALIZED_ACCEPTED_LENGTH).value)
    best, gains = ranked[0], late_gains(record)
    rows, values = [], {}
    for config in ranked:
        runs = config.runs
        late = [gains.runs[run_id][0].value for run_id in runs["run_id"] if gains and run_id in gains.runs]
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
    budget = (
        f"At {steps} steps per run the runs were **still improving** (mean gain over the last third "
        f"{gains.mean.text(signed=True)} over {len(gains.runs)} runs): the ranking is about {steps}-step drafts, "
        "not converged ones."
        if gains and gains.improving
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
    split, per_source = source_table(ranked, sources)
    for dataset, found in per_source.items():
        values[dataset]["by_source"] = found
    blocks = [about, table]
    if split is not None:
        blocks += ["The same runs on each validation source alone (its own documents, the same seeds):", split]
    return Record(f"`{record.name}` on {machine_kind()}", blocks, values, Provenance.now())


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
