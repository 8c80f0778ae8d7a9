"""bf16-auto against fp32 on the main job: the same designed study run at both precisions, paired run by run.

    python -m benchmarks.training.precision [--workdir work] [--study studies/default.yaml] [--n-jobs auto]

The study file runs as it is (its `train.precision`, `auto` by default: bf16 autocast on a CPU with native bf16)
and as a copy named `<name>-fp32` at fp32, both in --workdir, where the main job's caches are warm. A launch
that already finished there is read back from MLflow, not rerun, so the main job itself can be the first arm.

Each run is paired with the run of the other arm at the same design point (or reference baseline) and seed.
A pair's two runs start from the same weights and anchors but follow different trajectories, so the mean
difference over pairs, with its t interval over the pairs, holds both measurement and training noise; it is
labelled as the report labels an effect, against the study's margin. Speed: each pair's fp32 / bf16 run wall
time (geometric mean, t interval over pairs) and the two arms' summed run wall times. Adds a
record to benchmarks/training/PRECISION.md and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import yaml

from algorithms.metrics import ACCEPTED_LENGTHS
from benchmarks.common.records import ROOT, Page, Provenance, Record, Table, page_argument
from benchmarks.studies.time_to_verdict import launch
from harness.devices import computes_in, cpu_has_native_bf16
from harness.tracking import RunStatus
from harness.uncertainty import Estimate, mean_estimate
from reports.analysis import design_units, fit_recorded, recorded_design
from reports.collect import StudyRecord, collect
from reports.designed import term_label
from reports.effects import label

GROUP, PAGE = "training", "PRECISION"
FP32 = "fp32"


def arm_files(study: Path, out: Path) -> dict[str, Path]:
    """The study file as it is and its fp32 copy (named `<name>-fp32`)."""
    spec = yaml.safe_load(study.read_text())
    precision = spec["base"].get("train", {}).get("precision", "auto")
    if precision == FP32:
        raise SystemExit(f"error: invalid --study {study}: train.precision is already fp32; allowed auto or bf16")
    copy = {**spec, "name": f"{spec['name']}-fp32"}
    copy["base"] = {**spec["base"], "train": {**spec["base"].get("train", {}), "precision": FP32}}
    path = out / f"{copy['name']}.yaml"
    path.write_text(yaml.safe_dump(copy, sort_keys=False))
    return {precision: study, FP32: path}


def pair_key(row) -> str:
    """What makes two runs of the two arms the same run: design point (or baseline) and seed."""
    point = row["design_point"] or f"baseline:{row['baseline']}"
    return f"{point}|seed={row['seed']}"


def finished(record: StudyRecord):
    runs = record.runs
    return {pair_key(row): row for _, row in runs[runs["status"] == RunStatus.FINISHED].iterrows()}


def paired(auto: StudyRecord, fp32: StudyRecord) -> list[tuple]:
    a, b = finished(auto), finished(fp32)
    return [(a[key], b[key]) for key in sorted(a.keys() & b.keys())]


def geometric_mean_ratio(ratios: list[float]) -> Estimate:
    """exp of the mean log ratio, with the interval mapped back and the se by the delta method (ratio x log se)."""
    logs = mean_estimate(np.log(ratios))
    value = math.exp(logs.value)
    return Estimate(value, value * logs.se, math.exp(logs.low), math.exp(logs.high), logs.n)


def effects(record: StudyRecord) -> dict[str, str]:
    """Each fitted effect's text, named as the report names it."""
    recorded = recorded_design(record)
    fit, _ = fit_recorded(recorded, design_units(record, recorded))
    return {term_label(e.term, recorded.reference): e.text() for e in fit.effects}


def measure(args: argparse.Namespace) -> dict:
    scratch = args.workdir / "precision"
    scratch.mkdir(parents=True, exist_ok=True)
    files = arm_files(args.study, scratch)
    names = {}
    for arm, path in files.items():
        launch(path, args.workdir, args.n_jobs)
        names[arm] = yaml.safe_load(path.read_text())["name"]
    (precision,) = names.keys() - {FP32}
    records = {p: collect(name, args.workdir) for p, name in names.items()}
    pairs = paired(records[precision], records[FP32])
    margin = recorded_design(records[FP32]).margin
    differences = {}
    for metric in ACCEPTED_LENGTHS:
        estimate = mean_estimate([a[metric] - b[metric] for a, b in pairs])
        verdict, bound = label(estimate, margin)
        differences[metric] = {"estimate": estimate.text(signed=True), "label": verdict, "bound": bound}
    return {
        "precision": precision,
        "computes_in": computes_in("cpu", precision),
        "native_bf16": cpu_has_native_bf16(),
        "cpus": os.cpu_count(),
        "n_jobs": args.n_jobs,
        "pairs": len(pairs),
        "margin": margin,
        "differences": differences,
        "speedup_per_run": geometric_mean_ratio([b["wall_s"] / a["wall_s"] for a, b in pairs]).text(),
        "run_wall_min": {
            precision: sum(a["wall_s"] for a, _ in pairs) / 60,
            FP32: sum(b["wall_s"] for _, b in pairs) / 60,
        },
        "effects": {p: effects(record) for p, record in records.items()},
    }


def cell(text: str) -> str:
    """A markdown table cell: "|effect| < X" must not split it."""
    return text.replace("|", "\\|")


def record(result: dict) -> Record:
    precision = result["precision"]
    walls = result["run_wall_min"]
    rows = [[m, d["estimate"], d["label"]] for m, d in result["differences"].items()]
    arms = result["effects"]
    effect_rows = [[t, cell(arms[precision].get(t, "–")), cell(text)] for t, text in arms[FP32].items()]
    speed = "\n".join(
        [
            f"- Per run, fp32 wall time / {precision} wall time: {result['speedup_per_run']} (geometric mean over "
            "pairs).",
            f"- Summed run wall time: {walls[precision]:.1f} min at {precision}, {walls[FP32]:.1f} min at fp32 "
            f"({walls[FP32] / walls[precision]:.2f}x).",
        ]
    )
    blocks = [
        f"`{precision}` computes in {result['computes_in']} here. {result['pairs']} pairs: each run of the study "
        "against the fp32 run at the same design point and seed.",
        f"**Accepted lengths, {precision} − fp32** (mean over pairs, 95% t interval over pairs). A pair's runs follow "
        "different trajectories, so the interval holds training noise as well as measurement noise. Labels as the "
        f"report's, against the study's margin ±{result['margin']:g}.",
        Table(["metric (final validation, every anchor)", "difference", "label"], rows),
        "**Speed**",
        speed,
        "**The design's effects in each arm**",
        Table(["effect", precision, "fp32"], effect_rows),
    ]
    values = json.loads(json.dumps(result, default=str))
    return Record(f"{precision} against fp32", blocks, values, Provenance.now())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="with the main job's caches")
    parser.add_argument("--study", type=Path, default=ROOT / "studies" / "default.yaml", help="a designed study")
    parser.add_argument("--n-jobs", default="auto", help="as `study launch --n-jobs` (default: auto)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    args.study = args.study.resolve()
    result = measure(args)
    page = Page.named(GROUP, args.page or PAGE)
    print(f"recorded {page.add(record(result))}; rendered {page.path}")


if __name__ == "__main__":
    main()
