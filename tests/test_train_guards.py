"""Training refuses what cannot teach anything, before any run is recorded."""

from types import SimpleNamespace

import pytest

from algorithms import AlgorithmConfig
from harness.config import RunConfig
from harness.train import Workspace, train

from conftest import frozen_tensors, packed_row, tiny_target


def _workspace(tmp_path, train_rows):
    embed, head = frozen_tensors()
    target = SimpleNamespace(spec=tiny_target(), embed_weight=embed, head_weight=head, mask_token_id=5)
    data = SimpleNamespace(dataset_id="unsupervised.jsonl", dataset_hash="h", decontaminated=0)
    return Workspace(tmp_path, target, data, None, True, train_rows, [packed_row()], [packed_row((20,), pad=0)])


def test_a_training_set_without_supervised_tokens_is_refused(tmp_path):
    row = packed_row()
    row.loss_mask.zero_()
    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=1, candidate_top_k=4))
    config.data.dataset = "unsupervised.jsonl"
    with pytest.raises(ValueError, match=r"invalid --data='unsupervised.jsonl': the training set has no supervised"):
        train(config, _workspace(tmp_path, [row]), run_name="nothing-to-learn")
    assert not (tmp_path / "runs" / "nothing-to-learn").exists()


def test_a_run_whose_loss_is_zero_at_every_step_fails(tmp_path, monkeypatch):
    import torch

    from algorithms.dflash import StepOutput
    from harness.run import Run
    from harness.train import DegenerateRun, TrainingRecipe

    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=1, candidate_top_k=4))
    config.algorithm = config.algorithm.replace(mask_token_id=5, target_layer_ids=[2, 4, 5])
    config.train.max_steps, config.train.eval_every, config.train.checkpoint_every = 3, 100, 100
    recipe = TrainingRecipe(config, _workspace(tmp_path, [packed_row()]), Run(tmp_path, "zero"))
    zero = StepOutput(torch.zeros((), requires_grad=True), {})
    monkeypatch.setattr(recipe.draft, "training_forward", lambda row, anchors: zero)
    monkeypatch.setattr(
        recipe,
        "validate",
        lambda step: {"realized_accepted_length": 1.0, "unary_accepted_length": 1.0, "oracle_accepted_length": 1.0},
    )
    monkeypatch.setattr(recipe, "save", lambda step: None)
    with pytest.raises(DegenerateRun, match=r"the loss was exactly 0 at every step \(1..3\)"):
        recipe.train()


def test_a_resume_logs_the_checkpoints_unflushed_metrics_once(tmp_path, monkeypatch):
    """Killed between writing a checkpoint and flushing its metrics: the resume logs exactly what MLflow lacks."""
    import mlflow

    from harness import tracking
    from harness.run import Run
    from harness.train import TrainingRecipe

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=1, candidate_top_k=4))
    config.algorithm = config.algorithm.replace(mask_token_id=5, target_layer_ids=[2, 4, 5])
    run = Run(tmp_path, "killed-mid-save", experiment="flush-check")
    with run.active({}):
        curve = {"unary_accepted_length": 1.1, "realized_accepted_length": 1.2}
        run.log_metrics({"loss": 2.0}, tracking.TRAIN_PREFIX, 1)  # flushed before the kill
        run.log_metrics(curve, tracking.CURVE_PREFIX, 1)  # logged as curve/unary: the check reads that key
        recipe = TrainingRecipe(config, _workspace(tmp_path, [packed_row()]), run)
        recipe.unflushed = [
            ({"loss": 2.0}, tracking.TRAIN_PREFIX, 1),
            (curve, tracking.CURVE_PREFIX, 1),
            ({"loss": 1.5}, tracking.TRAIN_PREFIX, 2),
        ]
        recipe.log_unflushed()
    client = tracking.client(tmp_path)
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "train/loss")) == [1, 2]
    assert [m.step for m in client.get_metric_history(run.run_id, "curve/realized")] == [1]
    mlflow.set_tracking_uri("")


def test_a_micro_batch_without_a_supervised_slot_skips_the_optimizer_step(tmp_path, monkeypatch, caplog):
    """AdamW's momentum and weight decay would move the weights on a batch that taught nothing: the step is
    skipped, logged and counted; the next supervised batch steps as usual."""
    import logging
    import time

    import torch

    from algorithms.metrics import SKIPPED_STEPS
    from harness.run import Run
    from harness.train import TrainingRecipe

    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=1, candidate_top_k=4))
    config.algorithm = config.algorithm.replace(mask_token_id=5, target_layer_ids=[2, 4, 5])
    recipe = TrainingRecipe(config, _workspace(tmp_path, [packed_row()]), Run(tmp_path, "skips"))
    recipe.logged_at = time.perf_counter()
    isolated = packed_row()  # eligible anchors, but no anchor's block holds a supervised label
    isolated.loss_mask.zero_()
    isolated.loss_mask[[5, 10, 15, 25]] = 1
    before = {name: p.detach().clone() for name, p in recipe.draft.named_parameters()}
    monkeypatch.setattr(recipe, "training_row", lambda step: isolated)
    with caplog.at_level(logging.INFO, logger="harness.train"):
        recipe.step(0)
    assert "step 1: no supervised slot in the micro-batch; optimizer step skipped" in caplog.text
    assert all(torch.equal(p, before[name]) for name, p in recipe.draft.named_parameters())
    assert not recipe.optimizer.state  # no moments were ever taken
    assert recipe.step_stats()[SKIPPED_STEPS] == 1
    assert recipe.schedule.last_epoch == 1  # the LR still follows the step

    monkeypatch.setattr(recipe, "training_row", lambda step: packed_row())
    recipe.step(1)
    assert any(not torch.equal(p, before[name]) for name, p in recipe.draft.named_parameters())
    assert recipe.step_stats()[SKIPPED_STEPS] == 0


# ---- warmup-stable-decay and its branches ------------------------------------------------------------------


def test_the_wsd_factor_is_constant_then_decays_linearly_to_zero():
    from harness.config import learning_rate_factor

    factors = [learning_rate_factor(step, 20, 0.1, "wsd", 0.2) for step in range(20)]
    # 2 warmup steps, constant to step 15, then 4 decay steps: 4/4, 3/4, 2/4, 1/4
    assert factors == [0.5, 1.0] + [1.0] * 14 + [1.0, 0.75, 0.5, 0.25]


@pytest.mark.parametrize(
    "train, allowed",
    [
        ({"decay_ratio": 0.0}, r"decay_ratio=0.0: allowed a number in \(0, 1\)"),
        ({"branches": [100]}, r"branches=\[100\]: allowed only with schedule: wsd"),
        ({"branch_of": "trunk"}, r"branch_of='trunk': allowed only with schedule: wsd"),
        ({"schedule": "wsd", "branches": [300]}, r"branches=\[300\]: allowed budgets below max_steps=300"),
        ({"schedule": "wsd", "warmup_ratio": 0.5, "branches": [160]}, r"160 would start its decay at step 136"),
    ],
)
def test_wsd_knobs_out_of_range_are_refused_naming_the_knob(train, allowed):
    from harness.config import TrainConfig

    with pytest.raises(ValueError, match=allowed):
        TrainConfig(**train).validate()


def _wsd_recipe(tmp_path, name, max_steps, schedule="wsd", **train):
    from harness.run import Run
    from harness.train import TrainingRecipe

    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=1, candidate_top_k=4))
    config.algorithm = config.algorithm.replace(mask_token_id=5, target_layer_ids=[2, 4, 5])
    config.train.max_steps, config.train.schedule, config.train.warmup_ratio = max_steps, schedule, 0.0
    config.train.decay_ratio = 0.25
    for key, value in train.items():
        setattr(config.train, key, value)
    config.train.validate()
    rows = [packed_row(seed=seed) for seed in range(3)]
    return TrainingRecipe(config, _workspace(tmp_path, rows), Run(tmp_path, name))


def _steps(recipe, start, stop) -> list[float]:
    rates = []
    for step in range(start, stop):
        rates.append(recipe.schedule.get_last_lr()[0])
        recipe.step(step)
        if step + 1 in recipe.stable_steps:
            recipe.save_stable(step + 1)
    return rates


def test_a_wsd_branch_anneals_exactly_as_a_fresh_wsd_run_of_its_budget(tmp_path):
    """Without warmup, a branch of a 12-step WSD run at budget 8 (from its stable checkpoint at step 6) takes the
    same rows, anchors and learning rates as a fresh 8-step WSD run, so it ends on the same weights; a fresh run
    with the linear schedule does not."""
    import torch

    trunk = _wsd_recipe(tmp_path, "trunk", 12, branches=[8])
    _steps(trunk, 0, 12)
    assert (tmp_path / "runs" / "trunk" / "stable-step6.pt").exists()
    branch = _wsd_recipe(tmp_path, "trunk-decay8", 8, branch_of="trunk")
    branch.branch()
    assert branch.start_step == 6 and branch.branched_at == 6
    branch_rates = _steps(branch, 6, 8)
    fresh = _wsd_recipe(tmp_path, "fresh", 8)
    fresh_rates = _steps(fresh, 0, 8)
    assert branch_rates == fresh_rates[6:] == [1e-3 * 2 / 2, 1e-3 * 1 / 2]
    for (name, ours), theirs in zip(branch.draft.named_parameters(), fresh.draft.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    linear = _wsd_recipe(tmp_path, "linear", 8, schedule="linear")
    _steps(linear, 0, 8)
    assert not all(torch.equal(a, b) for a, b in zip(linear.draft.parameters(), fresh.draft.parameters(), strict=True))


def test_a_branch_refuses_a_parent_without_its_stable_checkpoint_or_with_other_knobs(tmp_path):
    trunk = _wsd_recipe(tmp_path, "trunk", 12, branches=[8])
    _steps(trunk, 0, 12)
    unlisted = _wsd_recipe(tmp_path, "trunk-decay4", 4, branch_of="trunk")
    with pytest.raises(FileNotFoundError, match=r"invalid --branch-of='trunk': no stable checkpoint at step 3"):
        unlisted.branch()
    other = _wsd_recipe(tmp_path, "trunk-decay8", 8, branch_of="trunk", learning_rate=0.01)
    with pytest.raises(ValueError, match=r"learning_rate=0.01, but that run trained with 0.001"):
        other.branch()


def test_a_run_starts_from_an_export_of_its_shape_and_refuses_another_in_one_line(tmp_path):
    """`init_from`: the export's weights (bf16, as exported) become the run's first weights; an export of another
    shape is refused naming the first tensor that differs."""
    import torch

    from harness.export import export_checkpoint

    source = _wsd_recipe(tmp_path, "source", 4, schedule="linear")
    _steps(source, 0, 4)
    export_checkpoint(source.replica, tmp_path / "export", "verifier")
    warm = _wsd_recipe(tmp_path, "warm", 4, schedule="linear", init_from=str(tmp_path / "export"))
    for (name, ours), theirs in zip(warm.draft.named_parameters(), source.draft.parameters(), strict=True):
        if ours.requires_grad:
            assert torch.equal(ours, theirs.detach().to(torch.bfloat16).float()), name
    config = RunConfig(AlgorithmConfig.preset("dflash", block_size=4, num_draft_layers=2, candidate_top_k=4))
    config.algorithm = config.algorithm.replace(mask_token_id=5, target_layer_ids=[2, 4, 5])
    config.train.init_from = str(tmp_path / "export")
    from harness.run import Run
    from harness.train import TrainingRecipe

    with pytest.raises(ValueError, match=r"invalid --init-from='.*export': it has no tensor layers\.1\.") as refused:
        TrainingRecipe(config, _workspace(tmp_path, [packed_row()]), Run(tmp_path, "other-shape"))
    assert len(str(refused.value).splitlines()) == 1
    config.train.init_from = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors there; allowed an export directory"):
        TrainingRecipe(config, _workspace(tmp_path, [packed_row()]), Run(tmp_path, "no-export"))
