"""The benchmarks' own logic on hand-built inputs (no MLflow, no training): precision pairing, standing verdicts."""

import math

import pandas as pd
import pytest
import yaml

from algorithms.metrics import ACCEPTED_LENGTHS
from benchmarks.precision import arm_files, geometric_mean_ratio, paired
from benchmarks.time_to_verdict import standing_from
from reports.collect import StudyRecord


def _record(rows: list[dict]) -> StudyRecord:
    base = {"status": "finished", "baseline": "", "design_point": "", "wall_s": 60.0}
    frame = pd.DataFrame([{**base, **{m: 1.0 for m in ACCEPTED_LENGTHS}, **row} for row in rows])
    return StudyRecord("s", {}, frame)


def test_runs_pair_by_design_point_and_seed_and_unmatched_or_unfinished_runs_drop_out():
    auto = _record(
        [
            {"run_name": "a1", "design_point": '{"k": 1}', "seed": "0"},
            {"run_name": "a2", "design_point": '{"k": 1}', "seed": "1"},
            {"run_name": "a3", "baseline": "dflash", "seed": "0"},
            {"run_name": "a4", "design_point": '{"k": 3}', "seed": "0"},  # no fp32 partner
        ]
    )
    fp32 = _record(
        [
            {"run_name": "f3", "baseline": "dflash", "seed": "0"},
            {"run_name": "f1", "design_point": '{"k": 1}', "seed": "0"},
            {"run_name": "f2", "design_point": '{"k": 1}', "seed": "1", "status": "failed"},
        ]
    )
    names = sorted((a["run_name"], b["run_name"]) for a, b in paired(auto, fp32))
    assert names == [("a1", "f1"), ("a3", "f3")]


def test_the_speed_up_is_a_geometric_mean_with_its_interval_mapped_back():
    estimate = geometric_mean_ratio([2.0, 8.0])  # logs 0.693 and 2.079: mean log 1.386 = log 4
    assert estimate.value == pytest.approx(4.0)
    half = 12.706 * (math.log(8) - math.log(2)) / 2  # t(1) * se of the mean of two logs
    assert estimate.low == pytest.approx(4.0 * math.exp(-half), rel=1e-3)
    assert estimate.high == pytest.approx(4.0 * math.exp(half), rel=1e-3)
    assert estimate.se == pytest.approx(4.0 * (math.log(8) - math.log(2)) / 2)  # delta method: ratio x se of mean log


def test_the_fp32_arm_is_the_study_renamed_at_fp32_and_an_fp32_study_is_refused(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"name": "s", "base": {"train": {"seed": 0}}, "seeds": [0]}))
    files = arm_files(study, tmp_path)
    assert files["auto"] == study
    copy = yaml.safe_load(files["fp32"].read_text())
    assert copy["name"] == "s-fp32" and copy["base"]["train"] == {"seed": 0, "precision": "fp32"}
    assert copy["seeds"] == [0]
    study.write_text(yaml.safe_dump({"name": "s", "base": {"train": {"precision": "fp32"}}}))
    with pytest.raises(SystemExit, match="already fp32"):
        arm_files(study, tmp_path)


def test_a_verdict_counts_only_from_the_fit_after_which_every_later_fit_agrees():
    assert standing_from([False, True, False, True, True]) == 3  # the lucky fit at 1 was overturned at 2
    assert standing_from([True, True]) == 0
    assert standing_from([True, False]) is None  # the whole design does not resolve: no verdict
    assert standing_from([]) is None


def test_a_speedup_row_pools_prompts_by_category_and_counts_what_the_drafts_gave():
    """Two categories of two prompts: the draft runs 30 and 60 tokens/s where the target alone runs 60 (a ratio
    of sums: 0.75 overall); 3 accepted drafts over 4 cycles (accepted length 1.75); 3 of 40 tokens from drafts."""
    from benchmarks.speedup import row
    from harness.serving import Completion

    def done(speed, accepted=(), drafted=0):
        return Completion(tokens=[0] * 10, accepted=list(accepted), tokens_per_s=speed, draft_n_accepted=drafted)

    alone = {"math": [done(60), done(60)], "coding": [done(60), done(60)]}
    served = {"math": [done(30, [1, 0], 1), done(30, [2], 2)], "coding": [done(60, [0]), done(60)]}
    name, speedup, length, from_drafts, categories = row("`d`", served, alone)
    assert speedup.startswith("0.75 [") and length == "1.75" and from_drafts == "7.5%"
    assert categories == "math 0.50 · coding 1.00"
