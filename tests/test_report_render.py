"""Reports rendered from recorded runs (no MLflow needed): the leaderboard and the component ablation."""

import pandas as pd

from algorithms.metrics import ORACLE_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH
from reports.collect import TUNED_KNOBS, StudyRecord
from reports.render import component_ablation, render


def _run(baseline: str, seed: int, unary: float, realized: float, oracle: float, status: str = "finished") -> dict:
    row = {
        "run_id": f"{baseline}-{seed}",
        "run_name": f"study-baseline-{baseline}-seed{seed}",
        "role": "baseline",
        "baseline": baseline,
        "trial": "",
        "status": status,
        "reason": "",
        "algorithm": baseline,
        "seed": str(seed),
        "top_k": 16,
        "parameters": 1000.0,
        "target": "t",
        "target_hash": "h",
        "dataset": "d",
        "dataset_hash": "dh",
        UNARY_ACCEPTED_LENGTH: unary,
        REALIZED_ACCEPTED_LENGTH: realized,
        ORACLE_ACCEPTED_LENGTH: oracle,
        "recall_at_k": 0.5,
        "target_mass_at_k": 0.4,
        "unary_recall_at_1": 0.3,
        "teacher_forced_selector_acc": 0.2,
        "draft_step_ms": 1.0,
        "measured_greedy": float("nan"),
        "measured_t1": float("nan"),
        "selector_gain": realized - unary,
        "oracle_headroom": oracle - realized,
        "unary_pos1": 0.5,
        "realized_pos1": 0.5,
        "oracle_pos1": 0.7,
    }
    row.update({knob: "" for knob in TUNED_KNOBS})
    return row


def _record(rows) -> StudyRecord:
    parent = {"run_id": "parent", "params": {}, "metrics": {}, "tags": {}}
    return StudyRecord("components", parent, pd.DataFrame(rows))


def test_component_ablation_states_gains_with_intervals_and_calls_noise_noise(tmp_path):
    rows = []
    for seed, base in enumerate((1.30, 1.35, 1.25)):
        rows += [
            _run("dflash", seed, base, base, 2.0),
            _run("dflash+conv", seed, base + 0.01 * (-1) ** seed, base + 0.01 * (-1) ** seed, 2.0),  # noise
            _run("dflash+selector", seed, base, base + 0.30 + 0.01 * seed, 2.0),  # a clear gain
            _run("dflash2", seed, base + 0.05, base + 0.40, 2.1),
        ]
    section = component_ablation(_record(rows))
    assert "## Component ablation" in section
    gains = [line for line in section.splitlines() if " − `dflash`" in line and "| realized |" in line]
    conv = next(line for line in gains if line.startswith("| `dflash+conv`"))
    selector = next(line for line in gains if line.startswith("| `dflash+selector`"))
    assert "not distinguishable from noise at this budget" in conv
    assert "| gain |" in selector and "+0.310" in selector
    markdown = render(_record(rows), tmp_path)
    assert "| run |" in markdown.split("## Leaderboard")[1]


def test_component_ablation_with_one_seed_gives_no_interval_and_is_absent_for_one_variant(tmp_path):
    rows = [_run("dflash", 0, 1.3, 1.3, 2.0), _run("dflash+selector", 0, 1.3, 1.6, 2.0)]
    section = component_ablation(_record(rows))
    assert "one seed: no interval" in section
    assert component_ablation(_record(rows[:1])) is None


def test_unfinished_runs_are_listed_as_problems_not_ranked(tmp_path):
    rows = [_run("dflash", 0, 1.3, 1.3, 2.0), _run("dflash2", 0, 1.2, 1.5, 2.0, status="infeasible")]
    markdown = render(_record(rows), tmp_path)
    problems = markdown.split("## Pruned, infeasible and failed runs")[1]
    assert "infeasible" in problems and "dflash2" in problems
    assert "dflash2" not in markdown.split("## Leaderboard")[1].split("##")[0]
