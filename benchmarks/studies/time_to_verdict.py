"""Time to a verdict: how long the component design (conv x selector, across seeds) takes until its conv effect
and its selector effect each have a 95% interval that includes training noise and excludes 0.

Each layout (precision x worker processes) launches the 2x2 component design through `dflash-lab study launch`
on the embedded target, with the main job's data (its feature cache warm in --workdir). Afterwards the runs are
replayed in the order they finished: after each one the design is fitted on the runs finished so far (as the
report fits them), and the verdict time is the first moment, counted from the launch, from which on both
effects stay resolved, in the whole design's fit too. A layout whose whole design does not resolve both says
so, with the intervals it ended on.

    python -m benchmarks.studies.time_to_verdict [--workdir work] [--steps 60] [--seeds 0,1,2] [--layouts auto:2,fp32:2]

A layout is PRECISION:JOBS with PRECISION fp32, auto or bf16 and JOBS the `--n-jobs` value. Prints one JSON line
and records in benchmarks/studies/TIME_TO_VERDICT.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.common.records import ROOT, Page, Provenance, Record, Table, page_argument
from harness import tracking
from harness.devices import computes_in
from reports.analysis import RecordedDesign, design_units, fit_recorded, recorded_design
from reports.collect import collect
from reports.effects import RESOLVED

GROUP, PAGE = "studies", "TIME_TO_VERDICT"
EFFECTS = ("conv", "selector")


def study_file(out: Path, name: str, steps: int, seeds: list[int], precision: str) -> Path:
    """The shipped component design at this budget, on the main job's data, at `precision`."""
    components = yaml.safe_load((ROOT / "studies" / "components.yaml").read_text())
    main_job = yaml.safe_load((ROOT / "studies" / "default.yaml").read_text())
    components["name"] = name
    components["base"]["data"] = main_job["base"]["data"]  # the warm feature cache
    components["base"]["train"] = {**main_job["base"]["train"], "precision": precision}
    components["budget"] = {"steps_per_trial": steps}
    components["seeds"] = seeds
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(components, sort_keys=False))
    return path


def standing_from(resolved: list[bool]) -> int | None:
    """The first index from which every entry is true; None when the last one is false."""
    index = len(resolved)
    while index > 0 and resolved[index - 1]:
        index -= 1
    return index if index < len(resolved) else None


def fit_summary(fit, at_s: float, runs: int) -> dict:
    effects = {e.term: e for e in fit.effects}
    return {
        "s": at_s,
        "runs": runs,
        "dof": fit.residual_dof,
        "effects": {term: effects[term].estimate.text(signed=True) for term in EFFECTS if term in effects},
        "resolved": all(term in effects and effects[term].label == RESOLVED for term in EFFECTS),
    }


def replay(recorded: RecordedDesign, record, launched: float) -> dict:
    """Fit the design after each finished run, in finishing order. The verdict is the first fit from which on
    every later fit, the whole design's included, resolves both effects: a fit on a few residual df can resolve
    an effect by luck that the finished design does not (seen at fp32, 40 steps: conv resolved at 6 of 8 runs,
    not at 8), and stopping there would report that luck."""
    ends = {row["run_name"]: row["end_s"] - launched for _, row in record.runs.iterrows()}
    units = sorted(design_units(record, recorded), key=lambda u: ends[u.name])
    fits = [
        fit_summary(fit_recorded(recorded, units[:count])[0], ends[units[count - 1].name], count)
        for count in range(1, len(units) + 1)
    ]
    standing = standing_from([f["resolved"] for f in fits])
    return {
        "verdict": fits[standing] if standing is not None else None,
        "first_resolved": next((f for f in fits if f["resolved"]), None),
        "final": fits[-1] if fits else None,
    }


def launch(path: Path, workdir: Path, n_jobs: str) -> None:
    """`dflash-lab study launch` without a report: runs what is left of the study (nothing, once finished)."""
    command = [sys.executable, "-m", "harness.cli", "study", "launch", str(path), "--workdir", str(workdir)]
    done = subprocess.run([*command, "--n-jobs", n_jobs, "--no-report"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: launching {path} failed: {done.stderr.strip().splitlines()[-1]}")


def measure(layout: str, args: argparse.Namespace, out: Path) -> dict:
    precision, jobs = layout.split(":")
    name = f"ttv-{precision}-{jobs}job-{args.steps}steps"
    launch(study_file(out, name, args.steps, args.seeds, precision), args.workdir, jobs)
    # Times come from MLflow (the parent run's start, each run's end), so a rerun on a finished study replays
    # the recorded launch instead of timing a relaunch that has nothing left to do.
    record = collect(name, args.workdir)
    record.runs["end_s"] = end_times(record, args.workdir)
    launched = tracking.client(args.workdir).get_run(record.parent["run_id"]).info.start_time / 1000
    result = replay(recorded_design(record), record, launched)
    total = float(record.runs["end_s"].max()) - launched
    return {"layout": layout, "computes_in": computes_in("cpu", precision), "study_s": total, **result}


def end_times(record, workdir: Path) -> list[float]:
    """Each run's end, in seconds since the epoch, from MLflow."""
    client = tracking.client(workdir)
    return [client.get_run(run_id).info.end_time / 1000 for run_id in record.runs["run_id"]]


def record(results: list[dict], args: argparse.Namespace) -> Record:
    def when(fit: dict | None) -> str:
        return f"{fit['s'] / 60:.1f} min ({fit['runs']} runs, {fit['dof']} df)" if fit else "never"

    rows = []
    for r in results:
        final = r["final"]
        effects = (
            ", ".join(f"{k} {v}" for k, v in final["effects"].items()) + f" ({final['dof']} df)"
            if final
            else "no finished run"
        )
        rows.append(
            [
                r["layout"],
                r["computes_in"],
                when(r["verdict"]),
                when(r["first_resolved"]),
                f"{r['study_s'] / 60:.1f} min",
                effects,
            ]
        )
    about = (
        f"The 2x2 component design at {args.steps} steps per run on the main job's data, feature cache warm. The "
        "design is fitted after each finished run, in finishing order (95% intervals on the residual df, training "
        "noise included). *Verdict* is the wall time from the launch until the conv and the selector effect are "
        "both resolved and stay resolved in every later fit, the whole design's included; *first resolved* is the "
        "first fit that resolved both, which a fit on few residual df can do by luck; *study* is the whole launch."
    )
    columns = ["layout (precision:jobs)", "computes in", "verdict", "first resolved", "study", "effects, whole design"]
    return Record(
        f"{args.steps} steps, seeds {','.join(map(str, args.seeds))}",
        [about, Table(columns, rows)],
        {"layouts": json.loads(json.dumps(results, default=str))},
        Provenance.now(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="with the main job's feature cache")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default: the main job's 60)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the design (default: 0,1,2)")
    parser.add_argument(
        "--layouts",
        default="auto:2,auto:1,fp32:2,fp32:1",
        help="PRECISION:JOBS,... (default: auto and fp32, 2 and 1 jobs)",
    )
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.layouts = args.layouts.split(",")
    for layout in args.layouts:
        if not re.fullmatch(r"(fp32|auto|bf16):[1-9][0-9]*", layout):
            raise SystemExit(f"error: invalid --layouts entry {layout!r}: allowed PRECISION:JOBS, e.g. fp32:2")
    scratch = args.workdir / "time-to-verdict"
    scratch.mkdir(parents=True, exist_ok=True)
    results = [measure(layout, args, scratch) for layout in args.layouts]
    page = Page.named(GROUP, args.page or PAGE)
    written = page.add(record(results, args))
    print(f"recorded {written}; rendered {page.path}")


if __name__ == "__main__":
    main()
