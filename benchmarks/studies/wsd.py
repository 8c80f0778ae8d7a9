"""Warmup-stable-decay against today's linear schedule at one budget, same seeds: is a WSD branch of a longer run
as good a drafter as a run trained for that budget from scratch?

Per seed: a WSD trunk of `--trunk` steps that keeps a stable checkpoint for `--budget`, its branch annealed to
`--budget` (`train --branch-of`), and a fresh linear run of `--budget` steps; all on the default study's base
config (DFlash2, block 8, 160 chitchat conversations) with the seed changed. The difference is the branch's final
realized accepted length (every anchor of the validation documents) minus the linear run's, per seed; its interval
is a t interval over seeds, so it holds the training noise a repeat would change:

    python -m benchmarks.studies.wsd --workdir work                # a record for benchmarks/studies/WSD.md
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from benchmarks.common.records import ROOT, Page, Provenance, Record, Table, page_argument
from harness import tracking
from harness.config import RunConfig, decay_steps
from harness.run import Run
from harness.train import prepare_workspace, train
from harness.uncertainty import mean_estimate
from studies.schema import load_study

GROUP, PAGE = "studies", "WSD"
TAG = "wsd-bench"  # run names: a second launch reads finished runs back and resumes a killed one
STUDY = ROOT / "studies" / "default.yaml"


def with_train(config: RunConfig, **train) -> RunConfig:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **train))


def trained(config: RunConfig, workspace, name: str) -> tuple[float, float | None]:
    """The run's final realized accepted length and its wall time: a finished run of this name is read back (its
    wall time from MLflow: first start to last end, a resumed run's pause included), a killed one resumes, a new one
    trains."""
    run = Run(workspace.workdir, name)
    if run.has_checkpoint():
        state = run.load_checkpoint()
        if state["step"] == config.train.max_steps:
            wall = tracking.wall_seconds(tracking.client(workspace.workdir).get_run(run.run_id).info)
            return state["history"][-1][REALIZED_ACCEPTED_LENGTH], wall
    started = time.monotonic()
    result = train(config, workspace, run_name=name, resume=run.exists())
    return result.validation[REALIZED_ACCEPTED_LENGTH], time.monotonic() - started


def one_seed(base: RunConfig, workspace, seed: int, trunk: int, budget: int) -> dict[str, float | None]:
    """The seed's three runs: each arm's final realized accepted length and wall time."""
    found: dict[str, float | None] = {}
    trunk_name = f"{TAG}-trunk{trunk}-seed{seed}"
    trunk_config = with_train(base, seed=seed, schedule="wsd", max_steps=trunk, branches=[budget])
    _, found["trunk_s"] = trained(trunk_config, workspace, trunk_name)
    branch = with_train(base, seed=seed, schedule="wsd", max_steps=budget, branch_of=trunk_name)
    found["wsd"], found["branch_s"] = trained(branch, workspace, f"{trunk_name}-decay{budget}")
    linear = with_train(base, seed=seed, schedule="linear", max_steps=budget)
    found["linear"], found["linear_s"] = trained(linear, workspace, f"{TAG}-linear{budget}-seed{seed}")
    print(f"seed {seed}: wsd branch {found['wsd']:.4f}, linear {found['linear']:.4f}", flush=True)
    return found


def minutes(seconds: float | None) -> str:
    return "not recorded" if seconds is None else f"{seconds / 60:.1f}"


def record(results: list[dict], args: argparse.Namespace, base: RunConfig, took_minutes: float) -> Record:
    branched_at = args.budget - decay_steps(args.budget, base.train.decay_ratio)
    differences = mean_estimate([r["wsd"] - r["linear"] for r in results])
    wsd, linear = mean_estimate([r["wsd"] for r in results]), mean_estimate([r["linear"] for r in results])
    rows = [
        [
            str(seed),
            f"{r['wsd']:.4f}",
            f"{r['linear']:.4f}",
            f"{r['wsd'] - r['linear']:+.4f}",
            f"{minutes(r['trunk_s'])} + {minutes(r['branch_s'])}",
            minutes(r["linear_s"]),
        ]
        for seed, r in zip(args.seeds, results, strict=True)
    ]
    verdict = (
        "the interval excludes 0"
        if differences.excludes_zero
        else "the interval includes 0: no difference resolved at this many seeds"
    )
    about = (
        f"{took_minutes:.0f} minutes in its last launch (runs a launch finds finished are read back, with their wall "
        "time from MLflow, which includes any wait under other load). The default study's base config (DFlash2, "
        f"block {base.algorithm.shared.block_size}, lr {base.train.learning_rate}, warmup {base.train.warmup_ratio}, "
        f"{base.data.num_conversations} conversations). Per seed: a WSD trunk of {args.trunk} steps (decay share "
        f"{base.train.decay_ratio}) branched at step {branched_at} and annealed to {args.budget}, against a fresh "
        f"linear-schedule run of {args.budget} steps. The value is the final validation's realized accepted length "
        "over every anchor of the validation documents."
    )
    columns = ["seed", "WSD branch", "linear", "branch − linear", "wall: trunk + branch (min)", "wall: linear (min)"]
    findings = "\n".join(
        [
            f"- WSD branch: {wsd.text()}; linear: {linear.text()} (95% t intervals over {len(results)} seeds).",
            f"- **Branch − linear: {differences.text(signed=True)}** ({verdict}).",
            f"- Cost: the branch's own steps are {args.budget - branched_at} of {args.budget}; the trunk is shared by "
            "every budget it branches at (here one), so WSD pays off once a trunk serves two or more budgets.",
        ]
    )
    values = {"difference": [differences.value, differences.low, differences.high], "per_seed": results}
    return Record(
        f"Budget {args.budget}, trunk {args.trunk}", [about, Table(columns, rows), findings], values, Provenance.now()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--budget", type=int, default=120, help="the budget both arms reach (default: 120)")
    parser.add_argument("--trunk", type=int, default=160, help="the WSD trunk's own steps (default: 160)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="seeds (default: 0 1 2 3)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    base = load_study(STUDY).base
    started = time.monotonic()
    workspace = prepare_workspace(base, args.workdir)
    results = [one_seed(base, workspace, seed, args.trunk, args.budget) for seed in args.seeds]
    page = Page.named(GROUP, args.page or PAGE)
    written = page.add(record(results, args, base, (time.monotonic() - started) / 60))
    print(f"recorded {written}; rendered {page.path}")


if __name__ == "__main__":
    main()
