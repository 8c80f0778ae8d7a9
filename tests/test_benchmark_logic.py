"""The benchmarks' own logic on hand-built inputs (no MLflow, no training): precision pairing, standing verdicts."""

import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from algorithms.metrics import ACCEPTED_LENGTHS
from benchmarks.studies.time_to_verdict import standing_from
from benchmarks.training.precision import arm_files, geometric_mean_ratio, paired
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


def completion(speed, accepted=(), drafted=0):
    from harness.serving.server import Completion

    return Completion(tokens=[0] * 10, accepted=list(accepted), tokens_per_s=speed, draft_n_accepted=drafted)


def test_a_speedup_row_pools_prompts_by_category_and_counts_what_the_drafts_gave():
    """Two categories of two prompts: the draft runs 30 and 60 tokens/s where the target alone runs 60 (a ratio
    of sums: 0.75 overall); 3 accepted drafts over 4 cycles (accepted length 1.75); 3 of 40 tokens from drafts."""
    from benchmarks.serving.speedup import row

    alone = {"math": [60.0, 60.0], "coding": [60.0, 60.0]}
    served = {
        "math": [completion(30, [1, 0], 1), completion(30, [2], 2)],
        "coding": [completion(60, [0]), completion(60)],
    }
    (name, speedup, length, from_drafts, categories), values = row("`d`", [served], [alone])
    assert speedup.startswith("0.75 [") and length == "1.75" and from_drafts == "7.5%"
    assert categories == "math 0.500 [0.500, 0.500] · coding 1.000 [1.000, 1.000]"
    assert values["accepted_length"] == 1.75 and values["by_category"]["math"] == [0.5, 0.5, 0.5]


def test_cuts_add_each_shorter_draft_and_each_confidence_cut_and_cut_only_leaves_the_whole_block_out():
    from pathlib import Path

    from benchmarks.serving.speedup import with_cuts
    from harness.serving.draft import ServedDraft

    draft = ServedDraft("d", "dflash2", Path("d.gguf"), 3, "draft-dflash", 1)
    served = [(draft, "run")]
    names = lambda found: [(d.name, d.block, d.confidence_cut) for d, _ in found]  # noqa: E731
    assert names(with_cuts(served, [2, 3], [0.8])) == [  # n-max 3 is the whole block: no cut
        ("d", 3, 0.0),
        ("d (n-max 2)", 2, 0.0),
        ("d (p-min 0.8)", 3, 0.8),
        ("d (n-max 2) (p-min 0.8)", 2, 0.8),
    ]
    assert names(with_cuts(served, [2], [0.8], cut_only=True)) == [
        ("d (n-max 2)", 2, 0.0),
        ("d (n-max 2) (p-min 0.8)", 2, 0.8),
    ]
    assert all(trained == "run" for _, trained in with_cuts(served, [1, 2], [0.5, 0.8]))


def test_over_rounds_a_speedup_rows_interval_is_over_the_rounds_and_a_recipe_row_over_seeds():
    """Two rounds of one prompt: speed-ups 0.5 and 0.7 give 0.6 with a t interval on 1 df (12.71 x se 0.1);
    two seeds of one recipe with round means 0.6 and 0.8 give 0.7 over seeds, and a run of another recipe (another
    learning rate) is not pooled with them."""
    import dataclasses

    from benchmarks.serving.speedup import recipe_rows, row
    from harness.presets import preset_run
    from harness.serving.draft import ServedDraft

    alone = [{"chat": [100.0]}, {"chat": [100.0]}]
    (_, speedup, *_), values = row("`d`", [{"chat": [completion(50)]}, {"chat": [completion(70)]}], alone)
    assert values["rounds"] == [0.5, 0.7] and speedup == "0.60 [-0.67, 1.87]"
    assert values["speedup"][1] == pytest.approx(0.6 - 12.7062 * 0.1, abs=1e-3)

    class Trained:  # what recipe_rows reads of a TrainedRun
        def __init__(self, name, config):
            self.run, self.config = type("R", (), {"name": name})(), config

    base = preset_run("small", "dflash2", "smollm2-135m")
    configs = {
        "s0": base,
        "s1": dataclasses.replace(base, train=dataclasses.replace(base.train, seed=1)),
        "lr": dataclasses.replace(base, train=dataclasses.replace(base.train, learning_rate=0.1)),
    }
    served = [
        (ServedDraft(name, "dflash2", Path(f"{name}.gguf"), 3, "draft-dflash", 1), Trained(name, config))
        for name, config in configs.items()
    ]
    found = {
        draft.label: {"rounds": rounds, "accepted_length": 1.5, "tokens_from_drafts": 0.2}
        for (draft, _), rounds in zip(served, ([0.5, 0.7], [0.8, 0.8], [0.1, 0.1]), strict=True)
    }
    ((cells, pooled),) = recipe_rows(served, found)
    assert pooled["seed_means"] == pytest.approx([0.6, 0.8]) and pooled["speedup"][0] == pytest.approx(0.7)
    assert pooled["speedup"][1] == pytest.approx(0.7 - 12.7062 * 0.1, abs=1e-3)
    assert cells[0].startswith("**recipe** `s0`, `s1` (2 seeds x 2 rounds") and cells[2:4] == ["1.50", "20.0%"]
    # the same two seeds with a confidence cut are a recipe of their own, not pooled with the uncut drafts
    cut = [(dataclasses.replace(d, name=f"{d.name} (p-min 0.5)", confidence_cut=0.5), t) for d, t in served[:2]]
    found |= {
        draft.label: {"rounds": [0.9, 0.9], "accepted_length": 2.0, "tokens_from_drafts": 0.5} for draft, _ in cut
    }
    # ... and so are they drafting fewer tokens than the block (n-max), a shape of its own
    short = [(dataclasses.replace(d, name=f"{d.name} (n-max 2)", block=2), t) for d, t in served[:2]]
    found |= {
        draft.label: {"rounds": [0.8, 0.8], "accepted_length": 1.4, "tokens_from_drafts": 0.2} for draft, _ in short
    }
    rows = recipe_rows(served + cut + short, found)
    assert [values["speedup"][0] for _, values in rows] == pytest.approx([0.7, 0.9, 0.8])
    assert rows[1][0][0].endswith("(2 seeds x 2 rounds, p-min 0.5)")
    assert rows[2][0][0].endswith("(2 seeds x 2 rounds, n-max 2)")
    # each row carries its label and draft shape, which the shortfall reads as data
    assert [(v["label"], v["block"], v["vocabulary"], v["confidence_cut"]) for _, v in rows] == [
        (rows[0][0][0], 4, None, 0.0),
        (rows[1][0][0], 4, None, 0.5),
        (rows[2][0][0], 3, None, 0.0),
    ]
    assert {v["trained_block"] for _, v in rows} == {8}  # the runs' config (the preset's block), not the served 3


def test_a_launch_serves_runs_of_one_data_up_to_its_size_past_the_largest_share(capsys):
    """Runs trained on 1,000 and 4,000 conversations of one dataset share a launch: the 4,000-run's config is the
    one whose held-out prompts are served (past every run's share); other data, or mixed sizes with the runs' own
    validation conversations as chat prompts, end in one line naming the run or the flag."""
    import dataclasses

    from benchmarks.serving.speedup import launch_config
    from harness.presets import preset_run

    small = preset_run("small", "dflash2", "smollm2-135m")
    small = dataclasses.replace(small, data=dataclasses.replace(small.data, num_conversations=1000))
    large = dataclasses.replace(small, data=dataclasses.replace(small.data, num_conversations=4000))
    seed1 = dataclasses.replace(small, train=dataclasses.replace(small.train, seed=1))
    assert launch_config([("a", small), ("b", large), ("c", seed1)], "sharegpt") is large
    assert launch_config([("a", small), ("c", seed1)], None) is small
    with pytest.raises(SystemExit, match=r"invalid --chat-data=None for runs trained on 1000, 4000 conversations"):
        launch_config([("a", small), ("b", large)], None)
    other = dataclasses.replace(small, data=dataclasses.replace(small.data, dataset="chitchat", seed=3))
    with pytest.raises(SystemExit, match=r"invalid --run='d': trained on other data or another target than 'a'"):
        launch_config([("a", small), ("d", other)], "sharegpt")


def test_the_target_alone_is_the_mean_of_its_passes_before_and_after_the_drafts():
    """A machine that sped up from 60 to 80 tokens/s during the launch: each prompt's baseline is 70, so a draft
    timed in between is not credited with the drift."""
    from harness.serving.timing import bracketed, mean_speed

    order = []
    passes = {
        "before": {"math": [completion(60), completion(50)], "chat": [completion(40)]},
        "after": {"math": [completion(80), completion(70)], "chat": [completion(60)]},
    }
    timed = bracketed(lambda when: order.append(when) or passes[when], lambda: order.append("drafts") or "drafted")
    assert order == ["before", "drafts", "after"] and timed.drafted == "drafted"
    assert timed.alone_speeds() == {"math": [70.0, 60.0], "chat": [50.0]}
    assert mean_speed(timed.before) == 50.0 and mean_speed(timed.after) == 70.0


def test_the_speed_up_curve_tables_every_point_names_the_best_and_plots(tmp_path):
    """The curve's table on hand-built points: lineage, data, steps, the interval and the break-even per row; the
    best by speed-up named with its break-even; the plot written where asked."""
    import argparse

    from benchmarks.serving.speedup_curve import Point, plot, render
    from harness.serving.break_even import BreakEven
    from harness.uncertainty import Estimate

    bar = BreakEven(60.0, (), 2.05, 1.95, 2.15)
    chat = Estimate(1.10, 0.05, 1.02, 1.18, 8)
    points = [
        Point("c1000-b4", "dflash2", 4, 2, 1000, 80_000, 1500, None, 2.05, 1.62, Estimate(0.81, 0.03, 0.75, 0.87, 32),
              1.95, chat, 0.31, 5.2, bar),
        Point("c1000-b4-decay500", "dflash2", 4, 2, 1000, 80_000, 500, "c1000-b4", 1.87, 1.41,
              Estimate(0.70, 0.03, 0.64, 0.76, 32), 1.70, chat, 0.22, None, bar),
    ]  # fmt: skip
    args = argparse.Namespace(
        runs="c1000-*", workdir="work", per_category=3, chat=8, tokens=128, until_eos=True, plot=tmp_path / "c.png"
    )
    engine = argparse.Namespace(commit="0c1e57098abc")
    found = render(args, engine, points, 60.0, 59.0, 12.0)
    text = found.markdown()
    assert "| `c1000-b4-decay500` (branch of `c1000-b4`) | dflash2 | 4 | 1000 (80,000) | 500 | 1.870 | 1.41 |" in text
    assert f"0.810 [0.750, 0.870] | 1.95, {chat.text()} |" in text
    assert "| 2.05 [1.95, 2.15] | 5.2 |" in text and "| – |" in text and "(c.png)" in text
    assert "Best: `c1000-b4`, accepted length 1.62, speed-up 0.810 [0.750, 0.870], against a break-even of 2.05" in text
    assert "up to 128 new tokens or the end of the reply" in text and found.provenance.engine == "0c1e57098abc"
    assert found.values["c1000-b4"]["break_even"] == 2.05 and found.values["c1000-b4"]["realized"] == 2.05
    plot(points, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_the_cycle_cost_reads_the_head_and_the_weights_from_the_gguf():
    """The estimate's inputs from the shipped Q4_1 target: its tensors' bytes, the vocabulary head's share and the
    parameter count (SmolLM2-135M: about 135M parameters, a 49,152 x 576 head)."""
    from benchmarks.serving.cycle_cost import gguf_bytes
    from harness.targets import embedded_gguf_path

    weights, head, parameters = gguf_bytes(embedded_gguf_path("smollm2-135m"))
    assert 130e6 < parameters < 140e6
    assert 0 < head < weights < 0.8 * parameters  # under 6.4 bits per weight: Q4_1 blocks, a Q8_0 head
    assert 49152 * 576 <= head <= 49152 * 576 * 1.1  # the tied head in Q8_0: 8.5 bits per weight


def test_a_served_drafts_log_is_named_by_its_run_and_variants_without_spaces():
    import dataclasses
    from pathlib import Path

    from benchmarks.serving.speedup import log_name
    from harness.serving.draft import ServedDraft

    full = ServedDraft("run-a", "dflash2", Path("work/runs/run-a/served/draft-f32.gguf"), 3, "draft-dflash", 1)
    reduced = ServedDraft(
        "run-a (vocabulary 4096)", "dflash2", full.gguf.with_name("x.gguf"), 3, "draft-dflash", 1, 4096
    )
    assert log_name(full) == "draft-run-a" and log_name(reduced) == "draft-run-a-vocabulary4096"
    cut = dataclasses.replace(reduced, name="run-a (vocabulary 4096) (n-max 2) (p-min 0.5)", confidence_cut=0.5)
    assert log_name(cut) == "draft-run-a-vocabulary4096-nmax2-pmin0.5"


def test_the_main_job_record_takes_the_reports_ngram_table_as_rendered():
    """benchmarks.studies.main_job keeps the report's n-gram table, lead and rows, and nothing after it."""
    from benchmarks.studies.main_job import NGRAM_TABLE
    from harness.serving import metrics as served_names
    from reports.sections import ngram_table

    row = {"run_name": "best", "served_speedup": 0.5, "served_speedup_low": 0.4, "served_speedup_high": 0.6}
    for column in served_names.NGRAM_COLUMNS:
        row |= {column: 1.1, f"{column}_se": 0.02}
    report = f"## Served{ngram_table(pd.DataFrame([row]))}\n\n## Next section\n"
    found = NGRAM_TABLE.search(report).group(0)
    assert found.startswith("**Beside llama.cpp's") and found.rstrip().endswith("| 1.10 ± 0.02 |")
    assert found.count("\n|") == 3 and "Next section" not in found
    assert NGRAM_TABLE.search("## Served\n\nno n-gram types here\n") is None


def test_the_shortfall_reads_the_best_recipe_its_break_even_the_cycle_split_and_the_curves_rate():
    """Hand-built records: the better recipe row (vocabulary 4096) is picked with the break-even of its own shape,
    the gap is break-even minus accepted length, the split is in plain tokens, and the curve's rate is over the
    trunks at the fewest and the most conversations (branches and other blocks left out)."""
    from benchmarks.common.records import Record, Table
    from benchmarks.serving.shortfall import shortfall_record

    def recipe(label: str, speedup: list[float], accepted: float, vocabulary=None, cut=0.0, block=4) -> dict:
        shape = {"block": block, "vocabulary": vocabulary, "confidence_cut": cut}
        return {"label": label, "speedup": speedup, "accepted_length": accepted} | shape

    recipes = [
        recipe("**recipe** `a`, `b` (2 seeds x 2 rounds)", [0.70, 0.60, 0.80], 1.30),
        recipe("**recipe** `a`, `b` (2 seeds x 2 rounds, vocabulary 4096)", [0.80, 0.40, 1.20], 1.40, 4096),
    ]
    break_evens = [
        {"block": 4, "vocabulary": None, "accepted_length": [2.00, 1.90, 2.10], "cycle_cost": 2.00},
        {"block": 4, "vocabulary": 4096, "accepted_length": [1.80, 1.70, math.inf], "cycle_cost": 1.60},
    ]
    served = Record("`a`, `b`", ["about"], {"f32": {"recipes": recipes, "break_even": break_evens}})
    # a record written before the rows carried their shape is passed over, not misread
    older = Record("older", ["about"], {"f32": {"recipes": [{"speedup": [2.0, 1.9, 2.1], "accepted_length": 3.0}]}})
    columns = ["run", "block", "conversations (supervised tokens)", "served accepted length"]
    curve_rows = [
        ["`c160`", "4", "160 (9,520)", "1.20"],
        ["`c1000`", "4", "1000 (67,616)", "1.30"],
        ["`c16000` (branch of `x`)", "4", "16000 (1)", "9.00"],
        ["`c16000-b2`", "2", "16000 (1)", "9.00"],
        ["`c2560`", "4", "2560 (1)", "1.40"],
    ]
    curve = Record("The curve", [Table(columns, curve_rows)])
    split = {"cycle_ms": 40.0, "verify_ms": 25.0, "draft_side_ms": 15.0}
    cycle = {"f32": {"plain_ms": 20.0, "batch_ms": {"3": 22.0, "4": 25.0}, "block4": split}}
    found = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test").values

    assert "vocabulary 4096" in found["best"]["label"] and found["best"]["speedup"] == [0.80, 0.40, 1.20]
    assert found["uncut"] == found["best"]
    assert found["break_even"] == [1.80, 1.70, math.inf]
    assert found["cycle_cost"] == 1.60 and found["gap"] == pytest.approx(0.40)
    assert found["split"] == {"plain_ms": 20.0, "verify": 1.25, "draft_side": 0.75, "cycle": 2.0}
    # 160 -> 2560 conversations is two fourfold steps for +0.20: 0.10 per step, so the 0.40 gap is 4 more
    assert found["curve"]["per_fourfold"] == pytest.approx(0.10)
    assert found["curve"]["fourfolds_needed"] == pytest.approx(4)
    assert "own_break_even" not in found  # the rows hold no seed means: no break-even of their own

    # With each seed's speed-up and accepted length, the drafts' own cycle is accepted / speed-up per seed: 1.35 /
    # 0.75 = 1.80 and 1.45 / 0.85 = 1.7059, a t interval over the two seeds (12.706 x their standard error)
    recipes[1] |= {"seed_means": [0.75, 0.85], "seed_accepted": [1.35, 1.45]}
    found = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test").values
    value, low, high = found["own_break_even"]
    assert value == pytest.approx((1.80 + 1.45 / 0.85) / 2) and found["own_gap"] == pytest.approx(value - 1.40)
    assert high - value == pytest.approx(value - low) == pytest.approx(12.706 * abs(1.80 - 1.45 / 0.85) / 2, rel=1e-3)
    assert found["gap"] == pytest.approx(0.40)  # the synthetic break-even's gap stays beside it
    # a record without per-seed accepted lengths uses the row's pooled one for each seed
    del recipes[1]["seed_accepted"]
    found = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test").values
    assert found["own_break_even"][0] == pytest.approx((1.40 / 0.75 + 1.40 / 0.85) / 2)

    # A confidence cut (p-min) that serves faster is the best, but the gap is the uncut drafts' in the same launch:
    # no synthetic break-even is a cut cycle's own
    label = "**recipe** `a`, `b` (2 seeds x 2 rounds, vocabulary 4096, p-min 0.6)"
    recipes.append(recipe(label, [0.90, 0.85, 0.95], 1.55, 4096, 0.6))
    # another recipe (other runs) served uncut at the same shape in the same launch: not the best one's own
    recipes.append(recipe("**recipe** `c`, `d` (2 seeds x 2 rounds, vocabulary 4096)", [0.75, 0.7, 0.8], 1.2, 4096))
    found = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test").values
    assert found["best"]["label"].endswith("p-min 0.6)") and found["best"]["accepted_length"] == 1.55
    assert found["uncut"]["label"].endswith("vocabulary 4096)") and found["gap"] == pytest.approx(0.40)

    # Drafting 2 tokens of the block (n-max 2) serves best: its break-even is its own block-3 shape's, and the cycle
    # benchmark split no such cycle, so its verify batch (3 positions) is read alone and the rest is not measured
    short = "**recipe** `a`, `b` (2 seeds x 2 rounds, vocabulary 4096, n-max 2)"
    recipes.append(recipe(short, [0.92, 0.80, 1.04], 1.30, 4096, block=3))
    recipes.append(recipe(short.replace(")", ", p-min 0.6)"), [0.95, 0.90, 1.00], 1.50, 4096, 0.6, block=3))
    break_evens.append({"block": 3, "vocabulary": 4096, "accepted_length": [1.50, 1.40, 1.60], "cycle_cost": 1.45})
    found = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test").values
    assert found["best"]["label"].endswith("n-max 2, p-min 0.6)") and found["uncut"]["label"] == short
    assert found["break_even"] == [1.50, 1.40, 1.60] and found["gap"] == pytest.approx(0.20)
    assert found["split"] == {"plain_ms": 20.0, "verify": 1.1, "draft_side": None, "cycle": None}
    assert "curve" not in found  # no block-3 curve, and these rows do not say what block their drafts trained at
    # rows that say it (block 4) read that block's curve instead, saying so: 0.20 at 0.10 per fourfold is 2 more
    for row in recipes[-2:]:
        row["trained_block"] = 4
    record = shortfall_record([curve, served, older], [Record("Blocks 4", [], cycle)], "test")
    assert record.values["curve"]["block"] == 4 and record.values["curve"]["fourfolds_needed"] == pytest.approx(2)
    assert "at the drafts' trained block 4 (no curve at block 3" in record.blocks[-1]
    assert record.values["split"]["cycle"] is None  # no cut cycle timed: the verify batch alone, as above
    # ... and where the cycle benchmark timed the block-4 draft cut to 2 tokens, that cycle is split in full
    cut = {"f32": cycle["f32"] | {"block4_n_max2": 30.0}}
    split = shortfall_record([curve, served], [Record("Blocks 4", [], cut)], "test").values["split"]
    assert split == pytest.approx({"plain_ms": 20.0, "verify": 1.1, "draft_side": 0.4, "cycle": 1.5})
    assert not any("The split was measured on" in str(block) for block in record.blocks)  # one (unknown) machine
    # a launch that served two depths of one block has a break-even per depth: the best row reads its own depth's
    deep = {"layers": 6, "trained_block": 4}
    recipes.append(
        recipe(
            "**recipe** `e`, `f` (2 seeds x 2 rounds, vocabulary 4096, n-max 2)", [0.96, 0.9, 1.0], 1.7, 4096, block=3
        )
        | deep
    )
    recipes.append(
        recipe(
            "**recipe** `e`, `f` (2 seeds x 2 rounds, vocabulary 4096, n-max 2, p-min 0.6)",
            [0.99, 0.95, 1.03],
            1.9,
            4096,
            0.6,
            block=3,
        )
        | deep
    )
    break_evens.append(
        {"block": 3, "layers": 6, "vocabulary": 4096, "accepted_length": [1.95, 1.9, 2.0], "cycle_cost": 1.8}
    )
    found = shortfall_record([curve, served], [Record("Blocks 4", [], cut)], "test").values
    assert found["best"]["label"].startswith("**recipe** `e`") and found["uncut"]["accepted_length"] == 1.7
    assert found["break_even"] == [1.95, 1.9, 2.0] and found["gap"] == pytest.approx(0.25)
    # a split measured on another machine than the served launch is named as such: plain tokens differ by machine
    from benchmarks.common.records import Provenance

    def on(flags: list[str]) -> Provenance:
        return Provenance("2026-12-07 08:00 UTC", "AMD EPYC", 2, flags, "abc", "test", "2.13")

    served.provenance = on(["avx2", "avx512_bf16"])
    record = shortfall_record([curve, served], [Record("Blocks 4", [], cycle, on(["avx2"]))], "test")
    assert (
        "The split was measured on AMD EPYC (2 cores; avx2), the served launch on AMD EPYC (2 cores; avx2, "
        "avx512_bf16)" in record.blocks[2]
    )
    # the launch also served the recipe at a quarter of the data (same shape, runs `g`, `h`): the curve is the
    # recipe's own, 1.45 -> 1.70 over one fourfold step, so the synthetic gap of 0.25 takes 1.0 more
    recipes.append(
        recipe(
            "**recipe** `g`, `h` (2 seeds x 2 rounds, vocabulary 4096, n-max 2)", [0.9, 0.8, 1.0], 1.45, 4096, block=3
        )
        | deep
    )
    served.values["runs"] = {
        name: {"conversations": count, "steps": steps}
        for names, count, steps in (("ef", 4000, 5000), ("gh", 1000, 3000))
        for name in names
    }
    record = shortfall_record([curve, served], [Record("Blocks 4", [], cut)], "test")
    assert record.values["curve"]["source"] == "recipe" and record.values["curve"]["per_fourfold"] == pytest.approx(
        0.25
    )
    assert "steps rising with them (3000 to 5000)" in record.blocks[-1]
    assert "the gap of 0.25 to the synthetic break-even takes 1.0 more fourfold steps" in record.blocks[-1]


def test_the_mixture_record_ranks_each_dataset_with_seed_noise_and_says_whether_the_runs_still_improved():
    """Three mixtures, two seeds each, realized 1.40 / 1.50 / 1.70 (+ seed noise), chit-chat 0.8 higher on its own
    half of the validation documents: the record ranks chit-chat first overall, states each other mixture's
    difference with it, its decontamination count and its late gain, and on each source alone ranks the mixtures
    again; every run's curve still rose over its last third, so the record says the runs were still improving."""
    import pandas as pd
    from test_report_render import DOCUMENTS as DOCUMENTS_OF_A_RUN
    from test_report_render import _run

    from algorithms.metrics import REALIZED_ACCEPTED_LENGTH, se_name
    from benchmarks.studies.data_mixture import mixture_record
    from harness.validation import SUM_SUFFIX, TOTAL_SUFFIX
    from reports.collect import StudyRecord

    levels = {"chitchat": 1.40, "sharegpt": 1.50, "sharegpt:4+magpie:1": 1.70}
    runs, curves, SOURCES = [], {}, ("sharegpt", "chitchat")
    half = DOCUMENTS_OF_A_RUN // 2  # the first half of each run's validation documents is ShareGPT's
    sources = [SOURCES[0]] * half + [SOURCES[1]] * (DOCUMENTS_OF_A_RUN - half)
    for trial, (dataset, level) in enumerate(levels.items()):
        for seed in (0, 1):
            row, documents = _run("", seed, level - 0.1, level + 0.01 * seed, level + 0.5, trial=trial)
            if dataset == "chitchat":  # 0.8 more accepted per anchor on chit-chat's own documents
                column = REALIZED_ACCEPTED_LENGTH + SUM_SUFFIX
                documents.loc[half:, column] += 0.8 * documents.loc[half:, REALIZED_ACCEPTED_LENGTH + TOTAL_SUFFIX]
            row |= {"dataset": dataset, "max_steps": 600, "wall_s": 120.0 + trial}
            runs.append((row, documents))
            curves[row["run_id"]] = pd.DataFrame(
                {
                    "step": [200, 400, 600],
                    REALIZED_ACCEPTED_LENGTH: [level - 0.2, level - 0.1, level],
                    se_name(REALIZED_ACCEPTED_LENGTH): [0.01] * 3,
                    "subset_rows": [200] * 3,
                }
            )
    record = StudyRecord(
        "data-mixture",
        {"run_id": "parent", "params": {}, "metrics": {}, "tags": {}},
        pd.DataFrame([row for row, _ in runs]),
        {row["run_id"]: documents for row, documents in runs},
        curves,
    )
    dropped = {row["run_id"]: "3" if row["dataset"] != "chitchat" else "0" for row, _ in runs}
    found = mixture_record(record, dropped, {row["run_id"]: sources for row, _ in runs})
    table = next(block for block in found.blocks if hasattr(block, "rows"))
    assert [row[0] for row in table.rows] == ["`chitchat`", "`sharegpt:4+magpie:1`", "`sharegpt`"]
    assert table.rows[0][5] == "best" and table.rows[0][6] == "0" and table.rows[1][6] == "3"
    realized = {dataset: found.values[dataset][REALIZED_ACCEPTED_LENGTH][0] for dataset in levels}
    assert realized["sharegpt"] - realized["sharegpt:4+magpie:1"] == pytest.approx(
        -0.20, abs=0.01
    )  # difficulty cancels
    versus_best = float(table.rows[2][5].split()[0])  # against the best overall, chit-chat
    assert versus_best == pytest.approx(realized["sharegpt"] - realized["chitchat"], abs=1e-3)
    assert table.rows[2][7] == "+0.100"
    assert "still improving" in found.blocks[0] and "600-step drafts" in found.blocks[0]
    by_source = {dataset: found.values[dataset]["by_source"] for dataset in levels}
    on_chitchat = by_source["chitchat"]["chitchat"][0] - by_source["sharegpt:4+magpie:1"]["chitchat"][0]
    on_sharegpt = by_source["sharegpt:4+magpie:1"]["sharegpt"][0] - by_source["chitchat"]["sharegpt"][0]
    assert on_chitchat == pytest.approx(0.5, abs=0.02) and on_sharegpt == pytest.approx(0.3, abs=0.02)
    split = found.blocks[-1]
    assert split.columns[1:] == [f"{kind} on {source}" for source in SOURCES for kind in ("realized", "− best")]
    # ranked overall, chit-chat first; ShareGPT+Magpie is the best on ShareGPT's documents, chit-chat on its own
    assert split.rows[1][2] == "best" and split.rows[0][4] == "best" and split.rows[0][2] != "best"


def test_the_acceptance_gap_reads_the_served_window_and_each_slots_conditional_rate():
    from benchmarks.serving.acceptance_gap import Decoded, position_rates, row_values

    # the prompt's own pass gives token 0; the cycles then start at tokens 1, 4, 5 and 7
    decoded = Decoded([3, 1, 2, 3])
    assert decoded.within(None) == [3, 1, 2, 3]
    assert decoded.within(5) == [3, 1]  # the cycle starting at token 5 is past a 5-token window
    assert decoded.within(6) == [3, 1, 2]
    # two drafted slots: slot 1 accepted in the cycles of length 2 and 3 (3 of 4); slot 2 reached by those 3, and
    # accepted in the two of length 3
    assert position_rates([3, 1, 2, 3], 2) == pytest.approx([3 / 4, 2 / 3])
    assert math.isnan(position_rates([1, 1], 2)[1])  # never reached
    found = row_values([decoded, Decoded([1, 1])], 2, 5)
    assert found["accepted_length"][0] == pytest.approx((2.0 + 1.0) / 2)  # per prompt, then over prompts
    assert (found["cycles"], found["prompts"]) == (4, 2)


def test_a_benchmark_refuses_a_run_that_is_not_there_in_one_line(tmp_path):
    from benchmarks.common.runs import load_run

    with pytest.raises(SystemExit, match=r"^error: invalid --run='nope': no checkpoint at .*nope/checkpoint.pt"):
        load_run("nope", tmp_path)


def test_the_shortfall_says_when_drafts_reach_their_own_break_even():
    from benchmarks.serving.shortfall import RecipeRow, ladder_text, own_text

    # seeds at 1.30 / 1.25 and 1.30 / 1.30: cycles of 1.04 and 1.00 plain tokens, below the 1.30 reached
    row = RecipeRow("**recipe** `a`, `b`", (1.27, 1.2, 1.3), 1.30, (3, 4096, 0.0), 4, 2, (1.25, 1.30), (1.30, 1.30))
    assert "they reached it, 0.28 above." in own_text(row, row.own_cycle())
    ladder = {"fewest": 1000, "most": 4000, "low": 1.2, "high": 1.3, "steps": [3000, 3000], "per_fourfold": 0.1}
    assert "The drafts reach their own break-even" in ladder_text(ladder, 0.1, -0.28)
    assert "steps rising" not in ladder_text(ladder, 0.1, -0.28)  # same steps at both sizes
