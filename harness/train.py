"""One tracked training run: prepare shared inputs, train with periodic validation, checkpoint, resume."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from algorithms import build_draft
from algorithms.blocks import PackedRow, sample_anchors
from algorithms.dflash import DFlashDraft
from algorithms.metrics import MetricCounts, finalize, pool
from harness import tracking
from harness.config import RunConfig
from harness.data import PreparedData, prepare_documents
from harness.features import FeatureCache, load_or_build
from harness.targets import Target, load_target

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the run stops without overwriting its last good checkpoint."""


@dataclass
class Workspace:
    """Inputs shared by every run on the same target, data and layers: loaded once per process."""

    workdir: Path
    target: Target
    data: PreparedData
    features: FeatureCache
    feature_cache_hit: bool
    train_rows: list[PackedRow]
    validation_rows: list[PackedRow]


def prepare_workspace(config: RunConfig, workdir: Path, device: str = "cpu") -> Workspace:
    """Target, regenerated data and the feature cache for `config` (the target runs only on a cache miss)."""
    target = load_target(config.target, workdir, config.algorithm.shared.mask_token_id, device)
    layer_ids = config.algorithm.shared.resolve_target_layer_ids(target.spec.num_hidden_layers)
    data = prepare_documents(target, config.data, workdir)
    documents = data.validation + data.train
    features, hit = load_or_build(target, documents, data.dataset_hash, layer_ids, config.data.max_length, workdir)
    validation_rows = features.packed_rows(0, data.validation, config.data.row_length)
    train_rows = features.packed_rows(len(data.validation), data.train, config.data.row_length)
    return Workspace(workdir, target, data, features, hit, train_rows, validation_rows)


def with_target_defaults(config: RunConfig, target: Target) -> RunConfig:
    """Pin the target-derived knobs (layer ids, mask token) so the recorded config is complete."""
    shared = config.algorithm.shared
    algorithm = config.algorithm.replace(
        target_layer_ids=shared.resolve_target_layer_ids(target.spec.num_hidden_layers),
        mask_token_id=shared.mask_token_id if shared.mask_token_id is not None else target.mask_token_id,
    )
    return RunConfig(algorithm, config.train, config.data, config.target)


def build_for_target(config: RunConfig, target: Target) -> DFlashDraft:
    return build_draft(config.algorithm, target.spec, target.embed_weight, target.head_weight)


def learning_rate_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Linear warmup, then linear or cosine decay to 0."""
    warmup = max(1, math.ceil(total * warmup_ratio)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 1 - progress) if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def validate(
    draft: DFlashDraft, rows: list[PackedRow], device: str, precision: str = "auto"
) -> tuple[dict[str, float], MetricCounts]:
    """Pooled metrics over every validation row, anchors seeded by the row index (D7)."""
    draft.eval()
    shared = draft.shared
    counts: MetricCounts = {}
    for index, row in enumerate(rows):
        generator = torch.Generator().manual_seed(index)
        anchors = sample_anchors(row.loss_mask, row.document_ids, shared.block_size, shared.max_anchors, generator)
        with autocast(device, precision):
            pool(counts, draft.training_forward(row.to(device), anchors_to(anchors, device)).counts)
    draft.train()
    return finalize(counts, shared.block_size, shared.first_draft_slot), counts


def anchors_to(anchors, device):
    return type(anchors)(anchors.positions.to(device), anchors.valid.to(device))


def autocast(device: str, precision: str):
    """bf16 autocast with fp32 master weights (spec §3.7), or fp32; `auto` is bf16 on CUDA and fp32 on CPU.

    bf16 on CPU is about 2x faster where the CPU has native bf16 (AVX512-BF16/AMX), much slower elsewhere.
    """
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def draft_step_ms(draft: DFlashDraft, rows: list[PackedRow], device: str, repeats: int = 8) -> float:
    """Median wall time of one inference draft step (one block over real validation context)."""
    draft.eval()
    row = rows[0].to(device)
    context = int((row.document_ids == row.document_ids[0]).sum()) - 1
    timings = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        draft.propose(row.features[:context], row.position_ids[:context], int(row.input_ids[context]), context)
        timings.append((time.perf_counter() - started) * 1000)
    draft.train()
    return sorted(timings[2:])[repeats // 2]


@dataclass
class TrainResult:
    run_id: str
    run_dir: Path
    validation: dict[str, float]
    history: list[dict] = field(default_factory=list)
    draft: DFlashDraft | None = None
    stopped_reason: str | None = None


def run_directory(workdir: Path, run_name: str) -> Path:
    return workdir / "runs" / run_name


def save_checkpoint(path: Path, state: dict) -> None:
    """Atomic: a kill mid-write leaves the previous checkpoint intact."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def per_position_rows(values: dict[str, float], block_size: int, first_slot: int, top_k: int) -> list[dict]:
    from algorithms.metrics import conditional_acc_name, recall_name

    return [
        {
            "slot": slot,
            "unary_acc": values.get(f"unary_position_{slot}_acc", 0.0),
            f"recall_at_{top_k}": values.get(f"{recall_name(top_k)}_position_{slot}", 0.0),
            **{
                f"{path}_conditional_acc": values.get(conditional_acc_name(path, slot), 0.0)
                for path in ("unary", "realized", "oracle")
            },
        }
        for slot in range(first_slot, block_size)
    ]


def train(
    config: RunConfig,
    workspace: Workspace,
    run_name: str | None = None,
    resume: bool = False,
    device: str = "cpu",
    tags: dict[str, str] | None = None,
    parent_run_id: str | None = None,
    on_validation: Callable[[int, dict[str, float]], str | None] | None = None,
    experiment: str = tracking.DEFAULT_EXPERIMENT,
) -> TrainResult:
    """Train one draft. `on_validation(step, metrics)` may return a reason to stop early (e.g. a pruned trial)."""
    import mlflow

    config = with_target_defaults(config, workspace.target)
    config.validate()
    run_name = run_name or f"{config.algorithm.algorithm}-{config.fingerprint()}"
    run_dir = run_directory(workspace.workdir, run_name)
    checkpoint_path = run_dir / "checkpoint.pt"
    experiment_id = tracking.configure(workspace.workdir, experiment)

    torch.manual_seed(config.train.seed)
    draft = build_for_target(config, workspace.target).to(device)
    optimizer = torch.optim.AdamW(
        [p for p in draft.parameters() if p.requires_grad],
        lr=config.train.learning_rate,
        weight_decay=config.train.weight_decay,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: learning_rate_factor(
            step, config.train.max_steps, config.train.warmup_ratio, config.train.schedule
        ),
    )
    anchor_generator = torch.Generator().manual_seed(config.train.seed)
    start_step, history, run_id = 0, [], None
    if resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        if state["config"] != config.to_dict():
            raise ValueError(
                f"--resume: the checkpoint in {run_dir} was written with a different config; use another --run-name"
            )
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        anchor_generator.set_state(state["anchor_generator"])
        start_step, history, run_id = state["step"], state["history"], state["run_id"]
        log.info("resuming %s at step %d (MLflow run %s)", run_name, start_step, run_id)
    elif checkpoint_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)

    run_tags = {
        tracking.TAG_ALGORITHM: config.algorithm.algorithm,
        tracking.TAG_ROLE: "run",
        tracking.TAG_RUN_DIR: str(run_dir.resolve()),
        **(tags or {}),
    }
    active = mlflow.start_run(
        run_id=run_id,
        experiment_id=None if run_id else experiment_id,
        run_name=None if run_id else run_name,
        tags=None if run_id else run_tags,
        parent_run_id=parent_run_id if not run_id else None,
        nested=parent_run_id is not None,
        log_system_metrics=True,
    )
    run_id = active.info.run_id
    try:
        if start_step == 0:
            (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
            tracking.log_params(
                {
                    **config.flat_params(),
                    **workspace.target.identity(),
                    "dataset": workspace.data.dataset_id,
                    "dataset_hash": workspace.data.dataset_hash,
                    "mask_token_reason": workspace.target.mask_token_reason,
                    "draft_parameters": sum(p.numel() for p in draft.parameters()),
                    "device": device,
                }
            )
            mlflow.log_artifact(str(run_dir / "config.json"))
            initial, _ = validate(draft, workspace.validation_rows, device, config.train.precision)
            mlflow.log_metrics(tracking.prefixed(initial, tracking.VAL_PREFIX), step=0)
            history.append({"step": 0, **initial})
        result = _loop(
            config,
            workspace,
            draft,
            optimizer,
            schedule,
            anchor_generator,
            start_step,
            history,
            run_id,
            run_name,
            checkpoint_path,
            device,
            on_validation,
        )
        if result.stopped_reason:
            mlflow.set_tag(tracking.TAG_STATUS_REASON, result.stopped_reason)
            mlflow.end_run(status="KILLED")
            return result
        step_ms = draft_step_ms(draft, workspace.validation_rows, device)
        result.validation["draft_step_ms"] = step_ms
        mlflow.log_metric(f"{tracking.VAL_PREFIX}draft_step_ms", step_ms, step=config.train.max_steps)
        _finish(config, result, run_dir, draft)
        return result
    except NonFiniteLoss as error:
        mlflow.set_tag(tracking.TAG_STATUS_REASON, str(error))
        mlflow.end_run(status="FAILED")
        raise
    except BaseException as error:  # a kill or a crash: record why, keep the last checkpoint
        mlflow.set_tag(tracking.TAG_STATUS_REASON, f"{type(error).__name__}: {error}")
        mlflow.end_run(status="KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()


def _loop(
    config,
    workspace,
    draft,
    optimizer,
    schedule,
    anchor_generator,
    start_step,
    history,
    run_id,
    run_name,
    checkpoint_path,
    device,
    on_validation,
) -> TrainResult:
    import mlflow

    shared, steps = config.algorithm.shared, config.train.max_steps
    rows = workspace.train_rows
    train_counts: MetricCounts = {}
    validation = history[-1] if history else {}
    bar = tqdm(range(start_step, steps), initial=start_step, total=steps, desc=f"train {run_name}", unit="step")
    for step in bar:
        epoch, position = divmod(step, len(rows))
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.train.seed * 100003 + epoch))
        row = rows[int(order[position])].to(device)
        anchors = sample_anchors(
            row.loss_mask, row.document_ids, shared.block_size, shared.max_anchors, anchor_generator
        )
        started = time.perf_counter()
        with autocast(device, config.train.precision):
            output = draft.training_forward(row, anchors_to(anchors, device))
        if not torch.isfinite(output.loss):
            raise NonFiniteLoss(
                f"non-finite loss {float(output.loss.detach())} at step "
                f"{step + 1}; last good checkpoint kept at {checkpoint_path}"
            )
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), config.train.grad_clip)
        optimizer.step()
        schedule.step()
        elapsed = time.perf_counter() - started
        pool(train_counts, output.counts)
        done = step + 1
        bar.set_postfix(
            loss=f"{float(output.loss.detach()):.3f}",
            val_realized=f"{validation.get('realized_accepted_length', 0):.3f}",
        )
        if done % config.train.log_every == 0 or done == steps:
            metrics = finalize(train_counts, shared.block_size, shared.first_draft_slot)
            train_counts = {}
            metrics.update(
                {
                    "lr": schedule.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "draft_tokens_per_s": int(anchors.valid.sum()) * shared.block_size / elapsed,
                    "target_feature_tokens_per_s": row.length / elapsed,
                }
            )
            mlflow.log_metrics(tracking.prefixed(metrics, tracking.TRAIN_PREFIX), step=done)
        if done % config.train.eval_every == 0 or done == steps:
            validation, _ = validate(draft, workspace.validation_rows, device, config.train.precision)
            mlflow.log_metrics(tracking.prefixed(validation, tracking.VAL_PREFIX), step=done)
            history.append({"step": done, **validation})
            log.info(
                "step %d: val realized %.3f unary %.3f oracle %.3f",
                done,
                validation["realized_accepted_length"],
                validation["unary_accepted_length"],
                validation["oracle_accepted_length"],
            )
            stop = on_validation(done, validation) if on_validation is not None else None
            if stop:
                bar.close()
                return TrainResult(run_id, checkpoint_path.parent, validation, history, draft, stopped_reason=stop)
        if done % config.train.checkpoint_every == 0 or done == steps:
            save_checkpoint(
                checkpoint_path,
                {
                    "model": draft.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": schedule.state_dict(),
                    "anchor_generator": anchor_generator.get_state(),
                    "step": done,
                    "history": history,
                    "run_id": run_id,
                    "config": config.to_dict(),
                },
            )
    bar.close()
    return TrainResult(run_id, checkpoint_path.parent, validation, history, draft)


def _finish(config: RunConfig, result: TrainResult, run_dir: Path, draft: DFlashDraft) -> None:
    """Final artifacts: per-position CSV and the checkpoint (or its path when large)."""
    import mlflow
    import pandas as pd

    shared = config.algorithm.shared
    table = pd.DataFrame(
        per_position_rows(
            result.validation, shared.block_size, shared.first_draft_slot, config.algorithm.knobs.candidate_top_k
        )
    )
    csv = run_dir / "per_position.csv"
    table.to_csv(csv, index=False)
    mlflow.log_artifact(str(csv))
    checkpoint = run_dir / "checkpoint.pt"
    if checkpoint.stat().st_size < 64 * 2**20:
        mlflow.log_artifact(str(checkpoint))
    mlflow.set_tag("dflash_lab.checkpoint", str(checkpoint.resolve()))
