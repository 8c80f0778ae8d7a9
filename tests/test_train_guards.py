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
    data = SimpleNamespace(dataset_id="unsupervised.jsonl", dataset_hash="h")
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
