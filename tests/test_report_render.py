"""Reports rendered from recorded runs (no MLflow needed): verdicts with intervals, noise called noise."""

import json
import math
import re
import zlib

import numpy as np
import pandas as pd
import pytest

from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    REALIZED_ACCEPTED_LENGTH,
    conditional_acc_name,
    recall_position_name,
    unary_position_acc_name,
)
from harness.serving import metrics as served_names
from harness.validation import ANCHORS_COLUMN, DOCUMENT_COLUMN, SUM_SUFFIX, TOTAL_SUFFIX
from reports.analysis import study_configurations
from reports.collect import TUNED_KNOBS, StudyRecord
from reports.estimates import configurations, difference
from reports.markdown import NOISE
from reports.render import render
from reports.sections import component_ablation

DOCUMENTS = 24
ANCHORS = np.random.default_rng(99).integers(20, 80, size=DOCUMENTS)
DIFFICULTY = np.random.default_rng(98).normal(0, 0.25, size=DOCUMENTS)  # shared by every run: pairing cancels it


def _documents(unary: float, realized: float, oracle: float, seed: int) -> pd.DataFrame:
    """Per-document pairs of one run: every document's level moves with its shared difficulty."""
    rng = np.random.default_rng(seed)
    frame = {DOCUMENT_COLUMN: range(DOCUMENTS), ANCHORS_COLUMN: [" ".join(map(str, range(n))) for n in ANCHORS]}
    for name, level in zip(ACCEPTED_LENGTHS, (unary, realized, oracle), strict=True):
        per_anchor = level + DIFFICULTY + rng.normal(0, 0.02, size=DOCUMENTS)
        frame[name + SUM_SUFFIX], frame[name + TOTAL_SUFFIX] = per_anchor * ANCHORS, ANCHORS.astype(float)
    for slot in (1, 2):
        frame[unary_position_acc_name(slot) + SUM_SUFFIX] = ANCHORS * 0.5
        frame[unary_position_acc_name(slot) + TOTAL_SUFFIX] = ANCHORS.astype(float)
        frame[recall_position_name(slot) + SUM_SUFFIX] = ANCHORS * 0.6  # every run records recall per slot
        frame[recall_position_name(slot) + TOTAL_SUFFIX] = ANCHORS.astype(float)
        for path in ("unary", "realized", "oracle"):
            frame[conditional_acc_name(path, slot) + SUM_SUFFIX] = ANCHORS * 0.4
            frame[conditional_acc_name(path, slot) + TOTAL_SUFFIX] = ANCHORS.astype(float)
    return pd.DataFrame(frame)


def _run(baseline: str, seed: int, unary: float, realized: float, oracle: float, status: str = "finished", trial=""):
    role = "trial" if trial != "" else "baseline"
    row = {
        "run_id": f"{baseline}-{trial}-{seed}",
        "run_name": f"study-{role}-{baseline or trial}-seed{seed}",
        "role": role,
        "baseline": baseline if role == "baseline" else "",
        "trial": str(trial),
        "config": f"{role}:{baseline if role == 'baseline' else trial}",
        "status": status,
        "reason": "",
        "algorithm": baseline or "dflash2",
        "seed": str(seed),
        "top_k": 16,
        "parameters": 1000.0,
        "target": "t",
        "target_hash": "h",
        "dataset": "d",
        "dataset_hash": "dh",
        "draft_step_ms": 1.0,
        "measured_greedy": float("nan"),
        "measured_t1": float("nan"),
        **dict(zip(ACCEPTED_LENGTHS, (unary, realized, oracle), strict=True)),
    }
    row.update({knob: "" for knob in TUNED_KNOBS})
    return row, _documents(unary, realized, oracle, seed=zlib.crc32(f"{baseline}{trial}{seed}".encode()))


def _record(runs, importances=None) -> StudyRecord:
    rows = [row for row, _ in runs]
    documents = {row["run_id"]: frame for row, frame in runs if row["status"] == "finished"}
    metrics = {f"importance/{k}": v for k, v in (importances or {}).items()}
    parent = {"run_id": "parent", "params": {}, "metrics": metrics, "tags": {}}
    return StudyRecord("components", parent, pd.DataFrame(rows), documents)


def _verdict_line(markdown: str, start: str) -> str:
    return next(line for line in markdown.split("## Verdicts")[1].splitlines() if line.startswith(start))


def test_a_difference_within_noise_declares_no_winner(tmp_path):
    runs = [_run("dflash", s, 1.3, 1.3, 2.0) for s in range(3)]
    runs += [_run("dflash2", s, 1.3, 1.3 + 0.03 * (-1) ** s, 2.0) for s in range(3)]  # seed noise only
    markdown = render(_record(runs), tmp_path)
    line = _verdict_line(markdown, "- baseline dflash2 − dflash baseline")
    assert NOISE in line and "[" in line
    assert "ahead" not in line


def test_a_clear_difference_is_stated_with_its_interval(tmp_path):
    runs = [_run("dflash", s, 1.3, 1.3, 2.0) for s in range(3)]
    runs += [_run("dflash2", s, 1.35, 1.7 + 0.01 * s, 2.2) for s in range(3)]
    markdown = render(_record(runs), tmp_path)
    line = _verdict_line(markdown, "- baseline dflash2 − dflash baseline")
    assert NOISE not in line
    dflash2, dflash = study_configurations(_record(runs))
    effect = difference(dflash2, REALIZED_ACCEPTED_LENGTH, dflash)
    assert effect.value == pytest.approx(0.41, abs=0.01) and effect.low > 0.3
    assert effect.text(signed=True) in line
    assert "paired by document and seed" in line


def test_component_ablation_states_gains_with_intervals_and_calls_noise_noise():
    runs = []
    for seed, base in enumerate((1.30, 1.35, 1.25)):
        runs += [
            _run("dflash", seed, base, base, 2.0),
            _run("dflash+conv", seed, base + 0.01 * (-1) ** seed, base + 0.01 * (-1) ** seed, 2.0),  # noise
            _run("dflash+selector", seed, base, base + 0.30 + 0.01 * seed, 2.0),  # a clear gain
            _run("dflash2", seed, base + 0.05, base + 0.40, 2.1),
        ]
    record = _record(runs)
    section = component_ablation(study_configurations(record))
    assert "## Component ablation" in section
    gains = [line for line in section.splitlines() if " − `dflash`" in line and "| realized |" in line]
    conv = next(line for line in gains if line.startswith("| `dflash+conv`"))
    selector = next(line for line in gains if line.startswith("| `dflash+selector`"))
    assert NOISE in conv
    assert "| gain |" in selector and "+0.30" in selector


def test_one_seed_intervals_carry_anchor_noise_and_say_seeds_were_not_measured(tmp_path):
    runs = [_run("dflash", 0, 1.3, 1.3, 2.0), _run("dflash+selector", 0, 1.3, 1.6, 2.0)]
    markdown = render(_record(runs), tmp_path)
    assert "the spread between seeds is not measured" in markdown
    assert "One seed per configuration" in markdown
    assert component_ablation(study_configurations(_record(runs[:1]))) is None


def test_seeds_report_which_noise_dominates(tmp_path):
    runs = [_run("dflash", s, 1.3, 1.3 + 0.2 * s, 2.0) for s in range(3)]  # a large spread between seeds
    markdown = render(_record(runs), tmp_path)
    row = next(line for line in markdown.split("## Seeds and noise")[1].splitlines() if "baseline dflash" in line)
    assert row.endswith("| seeds |")


def test_importances_need_enough_trials(tmp_path):
    runs = [_run("", 0, 1.3, 1.3 + 0.01 * t, 2.0, trial=t) for t in range(5)]
    for index, (row, _) in enumerate(runs):
        row["conv_kernel_size"] = str(1 + index % 3)
    markdown = render(_record(runs, importances={"conv_kernel_size": 0.9}), tmp_path)
    assert "importances are not shown: 5 completed trials" in markdown
    assert "| conv_kernel_size | 0.9" not in markdown
    assert (tmp_path / "knob_effects.png").exists()


@pytest.mark.parametrize("seeds", [2, 1])
def test_trials_that_differ_in_one_knob_alone_resolve_its_effect_by_seed_only_with_two_or_more_seeds(tmp_path, seeds):
    """Three data mixtures, one trial each, alike in every other knob: the effect of `dataset` is the best trial's
    difference with the worst, paired by document and seed; with one seed it has no training noise in it, so it is
    left unresolved."""
    runs = []
    for trial, (dataset, level) in enumerate({"chitchat": 1.6, "sharegpt": 1.35, "magpie": 1.3}.items()):
        for seed in range(seeds):
            row, documents = _run("", seed, level - 0.1, level + 0.01 * seed, level + 0.5, trial=trial)
            runs.append((row | {"dataset": dataset, "validation_data": "sharegpt:1+chitchat:1"}, documents))
    markdown = render(_record(runs), tmp_path)
    effect = next(line for line in markdown.splitlines() if line.startswith("**dataset**"))
    verdicts = markdown.split("## Verdicts")[1]
    if seeds == 2:
        assert "the trials differ in `dataset` alone: paired by document and seed, over 2 seeds" in effect
        assert effect.startswith("**dataset**: effect chitchat − magpie = +") and NOISE not in effect
        assert float(effect.split(" = ")[1].split()[0]) == pytest.approx(0.3, abs=0.02)
        assert "Knobs whose effect is distinguishable from noise: `dataset`" in verdicts
    else:
        assert "not resolved, a level with one trial" in effect
        assert "No knob's effect is distinguishable from noise" in verdicts


def test_unfinished_runs_are_listed_as_problems_not_ranked(tmp_path):
    runs = [_run("dflash", 0, 1.3, 1.3, 2.0), _run("dflash2", 0, 1.2, 1.5, 2.0, status="infeasible")]
    markdown = render(_record(runs), tmp_path)
    problems = markdown.split("## Pruned, infeasible and failed runs")[1]
    assert "infeasible" in problems and "dflash2" in problems
    assert "dflash2" not in markdown.split("## Leaderboard")[1].split("##")[0]
    assert len(configurations(_record(runs).runs, _record(runs).documents)) == 1


def _designed_record(conv_effect: float, selector_effect: float, rising: bool) -> StudyRecord:
    """A stored 2x2 component design on three seeds, with known effects and learning curves."""
    runs, curves = [], {}
    seed_noise = np.random.default_rng(5)
    for trial, (conv, selector) in enumerate(((False, False), (True, False), (False, True), (True, True))):
        for seed in range(3):
            realized = 1.2 + conv_effect * conv + selector_effect * selector + seed_noise.normal(0, 0.01)
            row, frame = _run("", seed, realized - 0.05, realized, realized + 0.3, trial=trial)
            row["design_point"] = f'{{"conv": {str(conv).lower()}, "selector": {str(selector).lower()}}}'
            row["wall_s"] = 60.0
            runs.append((row, frame))
            late = realized - (0.1 if rising else 0.0)
            curves[row["run_id"]] = pd.DataFrame(
                {
                    "step": [20, 40, 60],
                    REALIZED_ACCEPTED_LENGTH: [realized - 0.2, late, realized],
                    "realized_accepted_length_se": [0.01, 0.01, 0.01],
                    "subset_rows": [24, 24, 24],
                }
            )
    record = _record(runs)
    record.parent["params"] = {
        "study.design": '{"type": "factorial", "factors": {"conv": [false, true], "selector": [false, true]}}',
        "study.design_margin": "0.05",
        "study.design_interactions": "True",
        "study.seeds": "0,1,2",
    }
    record.curves = curves
    return record


def test_designed_report_labels_a_real_effect_resolved_and_nulls_bounded(tmp_path):
    markdown = render(_designed_record(conv_effect=0.2, selector_effect=0.0, rising=True), tmp_path)
    section = markdown.split("## Designed effects")[1].split("## Learning curves")[0]
    assert "full 2^2 factorial: 4 points" in section and "12 runs (12.0 min of run wall time), 8 residual" in section
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| `")}
    assert "| resolved |" in rows["`conv`"] and rows["`conv`"].split("|")[2].strip().startswith("+0.2")
    assert "| bounded |" in rows["`selector`"] and "| bounded |" in rows["`conv×selector`"]
    verdicts = markdown.split("## Verdicts")[1]
    assert "- `conv`: +0.2" in verdicts and ": resolved (8 residual df), at 60 steps, still improving." in verdicts
    assert "- `selector`: " in verdicts and "bounded, |effect| < 0.0" in verdicts
    # Every verdict, not only the design's, carries the budget; no knob-level comparison, no fANOVA section.
    lines = [line for line in verdicts.splitlines() if line.startswith("- ")]
    assert lines and all(line.endswith("at 60 steps, still improving.") for line in lines)
    assert "## Knob effects" not in markdown and "importances" not in markdown
    assert (tmp_path / "learning_curves.png").exists()


def test_designed_report_without_a_late_gain_says_so(tmp_path):
    markdown = render(_designed_record(conv_effect=0.0, selector_effect=0.0, rising=False), tmp_path)
    assert "No improvement over the last third is resolved at 60 steps. That is not convergence" in markdown
    verdicts = markdown.split("## Verdicts")[1]
    assert "still improving" not in verdicts and "at 60 steps." in verdicts
    assert "resolved (8 residual df)" not in verdicts.split("Selector gain")[0]


def _computed_in_line(runs, tmp_path) -> str:
    return next(line for line in render(_record(runs), tmp_path).splitlines() if line.startswith("- **Computed in:**"))


def test_the_header_counts_the_dtypes_the_runs_computed_in_and_flags_a_mix(tmp_path):
    runs = [_run("dflash", s, 1.3, 1.3, 2.0) for s in range(2)] + [_run("dflash", 2, 1.3, 1.3, 2.0, "infeasible")]
    assert _computed_in_line(runs, tmp_path).startswith("- **Computed in:** not recorded (2 runs). `auto`")
    for row, _ in runs:
        row["computes_in"] = "bf16"
    line = _computed_in_line(runs, tmp_path)
    assert line.startswith("- **Computed in:** bf16 (2 runs). `auto`") and "MIXED" not in line
    runs[1][0]["computes_in"] = "fp32"
    assert "bf16 (1 run), fp32 (1 run); MIXED: " in _computed_in_line(runs, tmp_path)


def test_a_served_run_gets_its_column_and_its_agreement_line(tmp_path):
    served, plain = _run("dflash", 0, 1.10, 1.10, 1.50), _run("", 0, 1.20, 1.40, 1.90, trial=1)
    served[0].update(
        served_greedy=1.104,
        served_greedy_se=0.01,
        served_agreement=0.98,
        served_cycles=50.0,
        served_flips=1.0,
        served_flips_harness=0.0,
        served_speedup=0.4,
    )
    markdown = render(_record([served, plain]), tmp_path)
    header = next(line for line in markdown.splitlines() if line.startswith("| run |"))
    assert "served (llama.cpp) T=0" in header and "served = harness cycles" in header
    section = markdown.split("## Served (llama.cpp)", 1)[1].split("\n## ", 1)[0]
    assert f"| `{served[0]['run_name']}` | 1.100 | – | 1.104 | 0.980 of 50 | 1 / 0 | 0.40 |" in section
    assert plain[0]["run_name"] not in section  # only runs an engine served
    served[0].update(served_speedup_se=0.021, served_speedup_low=0.357, served_speedup_high=0.443)
    section = render(_record([served, plain]), tmp_path).split("## Served (llama.cpp)", 1)[1]
    assert "| 1 / 0 | 0.400 [0.357, 0.443] | 1 |" in section  # with its interval over requests, when it was measured
    assert "training-free speculation" not in section  # no n-gram type was served beside it
    for index, column in enumerate(served_names.NGRAM_COLUMNS):
        served[0].update({column: 0.9 + index / 10, f"{column}_se": 0.01})
    section = render(_record([served, plain]), tmp_path).split("## Served (llama.cpp)", 1)[1]
    peers = section.split("**Beside llama.cpp's training-free speculation.**", 1)[1]
    assert "| run | draft | `ngram-mod` | `ngram-map-k` | `ngram-cache` | `ngram-simple` |" in peers
    assert f"| `{served[0]['run_name']}` | 0.400 [0.357, 0.443] | 0.90 ± 0.01 | 1.00 ± 0.01 | 1.10 ± 0.01 |" in peers
    without = render(_record([_run("dflash", 0, 1.10, 1.10, 1.50)]), tmp_path)
    assert "## Served" not in without and "served (llama.cpp)" not in without


def test_a_reference_arm_keeps_its_seed_spread_and_a_cited_transfer_reaches_the_verdicts(tmp_path):
    """The component design plus DFlash at three seeds, one budget, citing a transfer measured elsewhere: the
    regime line, each arm's noise, the Welch arm difference, and the cited label on each verdict it names."""
    record = _designed_record(conv_effect=0.2, selector_effect=0.0, rising=False)
    spread = [1.00, 1.06, 1.12]  # DFlash's seeds: sd 0.06, far above the design's 0.01
    runs = [_run("dflash", seed, value - 0.05, value, value + 0.3) for seed, value in enumerate(spread)]
    for row, frame in runs:
        row["wall_s"], row["max_steps"] = 60.0, 60
        record.documents[row["run_id"]] = frame
    record.runs = pd.concat([record.runs, pd.DataFrame([row for row, _ in runs])], ignore_index=True)
    cited = {"steps": 240, "source": "benchmarks/studies/BUDGET_TRANSFER.md", "labels": {"conv": "held", "arm": "grew"}}
    spec = {"type": "factorial", "factors": {"conv": [False, True], "selector": [False, True]}}
    record.parent["params"] |= {
        "study.design": json.dumps({**spec, "transfer_measured": cited}),
        "study.design_reference": "dflash",
        "study.steps_per_trial": "60",
    }
    markdown = render(record, tmp_path)
    assert "**Regime.** `dflash` (the reference) at 60 steps (3 seeds): unary top-1 accuracy" in markdown
    noise = markdown.split("**Training noise by arm.**")[1].split("\n\n")[1]
    reference_row = next(line for line in noise.splitlines() if line.startswith("| `dflash` (reference)"))
    runs_cell, spread_cell = reference_row.split("|")[2:4]
    assert runs_cell.strip() == "3" and spread_cell.strip().endswith("(between its seeds)")
    assert 0.05 < float(spread_cell.split()[0]) < 0.075  # the seeds' 0.06, plus each run's anchor noise
    assert (
        "**At 240 steps.** This study runs one budget." in markdown
        and "`benchmarks/studies/BUDGET_TRANSFER.md`" in markdown
    )
    arm = _verdict_line(markdown, "- design runs (mean over its points) − `dflash`")
    assert "(Welch, 3 reference runs), at 60 steps; at 240 steps grew (measured separately: " in arm
    # The interval holds DFlash's seed spread: at least t(2) * 0.06 / sqrt(3) either side.
    low, high = (float(x) for x in re.search(r"\[([-+0-9.]+), ([-+0-9.]+)\]", arm).groups())
    assert high - low > 2 * 4.30 * 0.06 / math.sqrt(3) * 0.95
    assert "at 240 steps held (measured separately" in _verdict_line(markdown, "- `conv`:")
    assert "at 240 steps" not in _verdict_line(markdown, "- `selector`:")


def test_the_report_states_where_served_runs_stand_against_their_break_even():
    """The best served run's accepted length beside its break-even, and whether any served run pays for itself;
    a study that served nothing says that this was not measured."""
    from types import SimpleNamespace

    from reports.analysis import served_standing
    from reports.sections import served_regime

    runs = pd.DataFrame(
        {
            "run_name": ["best", "reference", "unserved"],
            "served_greedy": [1.24, 1.02, float("nan")],
            "served_speedup": [0.51, 0.44, float("nan")],
            "served_break_even": [3.61, 3.58, float("nan")],
            "served_break_even_low": [3.40, 3.30, float("nan")],
            "served_break_even_high": [3.85, 3.80, float("nan")],
        }
    )
    text = served_regime(served_standing(SimpleNamespace(runs=runs)))
    assert "the best run (`best`) accepted 1.24 tokens per cycle (speed-up 0.51)" in text
    assert "break-even of 3.61 [3.40, 3.85], 2.37 short" in text and "none of the served runs pays for itself" in text
    runs.loc[1, ["served_greedy", "served_break_even"]] = [2.10, 1.95]
    text = served_regime(served_standing(SimpleNamespace(runs=runs)))
    assert "the best run (`reference`) accepted 2.10" in text and "1 of 2 served runs pay for themselves" in text
    unmeasured = served_standing(SimpleNamespace(runs=runs.drop(columns=["served_break_even"])))
    assert "was not measured here" in served_regime(unmeasured)


def test_a_two_objective_study_reports_the_trials_no_other_beats_on_both():
    """(realized, draft ms): trial 2 is beaten by trial 0 on both, so the front is trials 0 and 1, fastest first,
    with the swept knob beside their values; (served speed-up, draft ms) has its own front; a one-objective study
    has no such section."""
    from types import SimpleNamespace

    from reports.analysis import pareto
    from reports.collect import OTHER_KNOBS
    from reports.estimates import Configuration
    from reports.sections import pareto_section

    def trial(number, rank, realized, ms, speedup=float("nan")):
        row = {k: "" for k in (*TUNED_KNOBS, *OTHER_KNOBS)}
        row.update(
            {
                "seed": "0",
                "role": "trial",
                "algorithm": "dflash2",
                "selector_rank": rank,
                REALIZED_ACCEPTED_LENGTH: realized,
                "draft_step_ms": ms,
                "served_speedup": speedup,
            }
        )
        return Configuration(str(number), f"trial {number}", pd.DataFrame([row]), {"0": pd.DataFrame()})

    configs = [trial(0, "64", 1.30, 2.0, 0.9), trial(1, "16", 1.20, 1.5, 1.1), trial(2, "128", 1.25, 2.5, 0.95)]
    record = SimpleNamespace(parent={"params": {"study.objectives": "realized_accepted_length,draft_step_ms"}})
    section = pareto_section(pareto(record, configs), configs)
    assert "2 of 3 completed trials" in section
    rows = [line for line in section.splitlines() if re.match(r"\| trial \d", line)]
    assert rows == ["| trial 1 | 16 | 1.200 | 1.500 |", "| trial 0 | 64 | 1.300 | 2.000 |"]
    assert "| trial | selector_rank | realized_accepted_length | draft_step_ms |" in section
    # served speed-up against the step time: trial 1 is the fastest drafter and decodes fastest, so it alone stands
    record.parent["params"]["study.objectives"] = "served_speedup,draft_step_ms"
    section = pareto_section(pareto(record, configs), configs)
    assert "1 of 3 completed trials" in section and "served_speedup (higher is better)" in section
    assert [line for line in section.splitlines() if re.match(r"\| trial \d", line)] == [
        "| trial 1 | 16 | 1.100 | 1.500 |"
    ]
    record.parent["params"]["study.objectives"] = "realized_accepted_length"
    assert pareto(record, configs) is None and pareto_section(None, configs) is None


def test_the_leaderboard_shows_the_knobs_its_members_tune_and_the_others_that_differ():
    """A DFlash2-only study shows DFlash2's knobs, never another member's (all blanks); a family study shows each
    member's; a shared knob appears once it differs between configurations."""
    from algorithms import ALGORITHMS
    from reports.collect import OTHER_KNOBS
    from reports.estimates import Configuration
    from reports.sections import knob_columns

    def config(number, algorithm, **knobs):
        row = {k: "" for k in (*TUNED_KNOBS, *OTHER_KNOBS)} | {"algorithm": algorithm, "seed": "0"} | knobs
        return Configuration(str(number), f"trial {number}", pd.DataFrame([row]), {"0": pd.DataFrame()})

    dflash2 = [config(0, "dflash2", selector_rank="32"), config(1, "dflash2", selector_rank="128")]
    assert knob_columns(dflash2) == list(ALGORITHMS["dflash2"].tuned_knobs)
    family = [*dflash2, config(2, "domino", domino_rank="16")]
    shown = knob_columns(family)
    assert set(ALGORITHMS["domino"].tuned_knobs) <= set(shown) and set(ALGORITHMS["dflash2"].tuned_knobs) <= set(shown)
    assert not set(shown) - set(ALGORITHMS["dflash2"].tuned_knobs) - set(ALGORITHMS["domino"].tuned_knobs)
    shared = OTHER_KNOBS[0]
    widened = [config(0, "dflash2", **{shared: "4"}), config(1, "dflash2", **{shared: "8"})]
    assert knob_columns(widened) == [*ALGORITHMS["dflash2"].tuned_knobs, shared]
