"""The component design served (studies/components-served.yaml), recorded from its tracking store: what it cost,
each component's effect on the served speed-up in llama.cpp beside its effect on offline acceptance, with launch and
seed noise inside the intervals, and each arm's mean.

    dflash-lab study launch studies/components-served.yaml --workdir work
    python -m benchmarks.studies.components_served --workdir work --note "nothing else running"

The record goes into benchmarks/studies/COMPONENTS_SERVED.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness import tracking
from harness.serving import metrics as served_names
from reports.analysis import analyse
from reports.collect import collect
from reports.designed import agreement, effect_cell

GROUP, PAGE, STUDY = "studies", "COMPONENTS_SERVED", "components-served"


def measure(args: argparse.Namespace) -> Record:
    record = collect(args.study, args.workdir)
    analysis = analyse(record)
    design = analysis.design
    if design is None or design.served is None:
        raise SystemExit(f"error: invalid --study={args.study!r}: not a design with a served objective")
    offline, served = design.first.fit, design.served.fit.fit
    if not served.effects:
        raise SystemExit(f"error: no served effect is estimable yet: {served.note}")
    by_term = {e.term: e for e in offline.effects}
    rows = [
        [f"`{e.term}`", effect_cell(by_term[e.term]) if e.term in by_term else "–", effect_cell(e)]
        for e in served.effects
    ]
    rows = [
        [*row, f"{e.detectable:.3f}", agreement(by_term.get(e.term), e)]
        for row, e in zip(rows, served.effects, strict=True)
    ]
    arms = {}
    for unit in design.served.fit.units:
        arms.setdefault(json.dumps(unit.point, sort_keys=True), []).append(unit.value)
    realized = {}
    for unit in design.first.units:
        realized.setdefault(json.dumps(unit.point, sort_keys=True), []).append(unit.value)
    arm_rows = [
        [point, f"{np.mean(realized.get(point, [math.nan])):.3f}", f"{np.mean(values):.3f}", len(values)]
        for point, values in sorted(arms.items())
    ]
    runs = record.runs
    wall_s = tracking.wall_seconds(tracking.client(args.workdir).get_run(record.parent["run_id"]).info)
    steps = sorted(set(runs["max_steps"]))
    launches = design.served.launches
    about = (
        f"`{args.study}`: {len(runs)} runs ({', '.join(map(str, steps))} steps each), the parent run's wall time "
        f"{wall_s / 60:.0f} min (training, validation and serving). Every run served by llama.cpp for its speed alone "
        f"in rounds of fresh launches; a run's standard error is the launch sd pooled over {launches.runs} runs "
        f"({launches.dof} df), {launches.sd:.3f}, over √rounds; the seeds' noise between runs beyond it, "
        f"τ = {math.sqrt(served.tau2):.3f}; {served.residual_dof} residual df. {args.note}".strip()
    )
    values = {
        "study": args.study,
        "runs": len(runs),
        "steps": [int(s) for s in steps],
        "wall_s": wall_s,
        "launch_sd": launches.sd,
        "launch_dof": launches.dof,
        "tau_served": math.sqrt(served.tau2),
        "residual_dof": served.residual_dof,
        "effects": {
            e.term: {
                "served": [e.estimate.value, e.estimate.low, e.estimate.high, e.label],
                "served_detectable": e.detectable,
                "offline": [getattr(by_term[e.term].estimate, k) for k in ("value", "low", "high")],
            }
            for e in served.effects
            if e.term in by_term
        },
        "arms": {point: values for point, values in arms.items()},
    }
    response = f"`{served_names.OBJECTIVE_SPEEDUP}`"
    effects = Table(["effect (high − low)", "offline realized", response, "detectable", "reading"], rows)
    arm_table = Table(["point", "realized (mean)", "served speed-up (mean)", "runs"], arm_rows)
    title = f"`{args.study}` at {', '.join(map(str, steps))} steps"
    return Record(title, [about, effects, arm_table], values, Provenance.now())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"))
    parser.add_argument("--study", default=STUDY)
    parser.add_argument("--note", default="", help="what the numbers cannot say (other load, a cached build)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    page = Page.named(GROUP, args.page or PAGE).titled("The DFlash2 components served: do they pay for their cost?")
    found = measure(args)
    page.publish(found)


if __name__ == "__main__":
    main()
