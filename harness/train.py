"""One tracked training run: prepare shared inputs, train with periodic validation, checkpoint, resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from algorithms import build_draft
from algorithms.blocks import Anchors, PackedRow, eligible_anchor_mask, sample_anchors
from algorithms.dflash import DFlashDraft, StepOutput
from algorithms.metrics import (
    DRAFT_STEP_MS,
    FINAL_VALIDATION_S,
    ORACLE_ACCEPTED_LENGTH,
    REALIZED_ACCEPTED_LENGTH,
    SKIPPED_STEPS,
    UNARY_ACCEPTED_LENGTH,
    MetricCounts,
    finalize,
    pool,
)
from harness import tracking
from harness.config import ONLINE_FEATURES, RunConfig, decay_steps, learning_rate_factor
from harness.data import PreparedData, prepare_documents
from harness.devices import autocast, computes_in, generator, synchronize, to_device, uses_bf16
from harness.distributed import SINGLE, Ranks, full_state, load_full_state, plain_number, shard, unsharded_copy
from harness.export import NoPeerFormat, export_checkpoint, peer_format, warm_start
from harness.features import FeatureSource, OnlineFeatures, document_rows, fill, load_or_build, packed_rows
from harness.files import atomic_write, remove_stale_temporaries
from harness.plots import per_position_figure
from harness.run import (
    CONFIG_FILE,
    EXPORT_DIR,
    PER_POSITION_FIGURE,
    PER_POSITION_FILE,
    VALIDATION_DOCUMENTS_FILE,
    Run,
    RunInUse,
)
from harness.targets import Target, load_target
from harness.tracking import RunStatus
from harness.validation import (
    Validation,
    curve_values,
    per_position_rows,
    pooled_counts,
    summary_line,
    validate_documents,
    validate_subset,
)

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the run stops without overwriting its last good checkpoint."""


class DegenerateRun(RuntimeError):
    """Training ran but could not learn anything: a failed run, not a finished one."""


@dataclass
class Workspace:
    """Inputs shared by every run on the same target, data and layers: loaded once per process."""

    workdir: Path
    target: Target
    data: PreparedData
    features: FeatureSource  # the cache, or the target itself (online mode)
    feature_cache_hit: bool
    train_rows: list[PackedRow]  # without features in online mode: `training_row` fills them
    validation_rows: list[PackedRow]  # packed: the intermediate validations' fixed subset of anchors
    validation_documents: list[PackedRow]  # one per document: the final validation's every anchor
    train_members: list[list[int]] = field(default_factory=list)  # each training row's document indices

    def training_row(self, index: int) -> PackedRow:
        """Training row `index` with its features (computed now by the target in online mode)."""
        row = self.train_rows[index]
        if row.features.numel():
            return row
        return fill(dataclasses.replace(row), self.train_members[index], self.features, len(self.data.validation))


@dataclass
class Workspaces:
    """The workspace of each run's data, built on first use: a study that sweeps its data trains each value on its
    own documents and features. Only the last one used stays in memory, since a workspace holds its rows' features."""

    workdir: Path
    device: str = "cpu"
    _current: Workspace | None = None
    _built_for: RunConfig | None = None

    def of(self, config: RunConfig) -> Workspace:
        if self._current is None or not self._holds(config):
            self._current, self._built_for = prepare_workspace(config, self.workdir, self.device), config
        return self._current

    def _holds(self, config: RunConfig) -> bool:
        """Whether the workspace in memory has `config`'s target, data, features and layers (compared resolved: a
        run's checkpoint pins the layer ids its study left to the target)."""
        layers = self._current.target.spec.num_hidden_layers
        return workspace_identity(config, layers) == workspace_identity(self._built_for, layers)


def workspace_identity(config: RunConfig, num_target_layers: int) -> tuple:
    layer_ids = config.algorithm.shared.resolve_target_layer_ids(num_target_layers)
    return config.target, config.data, config.train.features, config.train.feature_precision, tuple(layer_ids)


def prepare_workspace(config: RunConfig, workdir: Path, device: str = "cpu", ranks: Ranks = SINGLE) -> Workspace:
    """Target, regenerated data and the features for `config`: the cache (the target runs only on a miss), or
    the target itself in online mode, which writes nothing and computes training rows' features per step.

    Under torchrun rank 0 converts the target and regenerates the data first, then the other ranks read them;
    a missing cache is extracted by all ranks together."""
    if ranks.is_main:
        for cache in ("targets", "data", "features"):
            remove_stale_temporaries(workdir / cache)
        target, data = _target_and_data(config, workdir, device)
    ranks.barrier()
    if not ranks.is_main:
        target, data = _target_and_data(config, workdir, device)
    layer_ids = config.algorithm.shared.resolve_target_layer_ids(target.spec.num_hidden_layers)
    documents = data.validation + data.train
    online = config.train.features == ONLINE_FEATURES
    if online:
        features, hit = OnlineFeatures(target, documents, layer_ids, config.train.feature_precision), False
        log.info("online features: the target computes them inside each training step; no cache is written")
    else:
        features, hit = load_or_build(
            target,
            documents,
            data.dataset_hash,
            layer_ids,
            config.data.max_length,
            workdir,
            ranks=ranks,
            precision=config.train.feature_precision,
        )
    validation_rows, _ = packed_rows(features, 0, data.validation, config.data.row_length)
    train_rows, members = packed_rows(
        features, len(data.validation), data.train, config.data.row_length, with_features=not online
    )
    validation_documents = document_rows(features, 0, data.validation)
    return Workspace(workdir, target, data, features, hit, train_rows, validation_rows, validation_documents, members)


def _target_and_data(config: RunConfig, workdir: Path, device: str) -> tuple[Target, PreparedData]:
    target = load_target(config.target, workdir, config.algorithm.shared.mask_token_id, device)
    return target, prepare_documents(target, config.data, workdir)


def with_target_defaults(config: RunConfig, target: Target) -> RunConfig:
    """Pin the target-derived knobs (layer ids, mask token) so the recorded config is complete."""
    shared = config.algorithm.shared
    algorithm = config.algorithm.replace(
        target_layer_ids=shared.resolve_target_layer_ids(target.spec.num_hidden_layers),
        mask_token_id=shared.mask_token_id if shared.mask_token_id is not None else target.mask_token_id,
    )
    return RunConfig(algorithm, config.train, config.data, config.target)


def build_for_target(config: RunConfig, target: Target) -> DFlashDraft:
    layers = target.layers if config.algorithm.shared.draft_init == "target" else None  # read only when copied
    return build_draft(config.algorithm, target.spec, target.embed_weight, target.head_weight, layers)


def checkpoint_config(state: dict) -> RunConfig:
    """The config a checkpoint (`Run.load_checkpoint()`) was trained with."""
    return RunConfig.from_dict(state["config"])


def restore_draft(state: dict, target: Target, device: str = "cpu") -> DFlashDraft:
    """A checkpoint's weights in a draft for `target`."""
    draft = build_for_target(checkpoint_config(state), target).to(device)
    draft.load_state_dict(state["model"])
    return draft


@dataclass
class TrainedRun:
    """A run's last checkpoint and the config it was trained with: the one way from a run to its target and draft
    (loaded in two steps, so a caller can refuse what the config cannot do before the target loads)."""

    run: Run
    state: dict
    config: RunConfig

    @classmethod
    def load(cls, run: Run) -> TrainedRun:
        state = run.load_checkpoint()
        return cls(run, state, checkpoint_config(state))

    def load_target(self, device: str = "cpu") -> Target:
        return load_target(self.config.target, self.run.workdir, self.config.algorithm.shared.mask_token_id, device)

    def draft(self, target: Target, device: str = "cpu") -> DFlashDraft:
        return restore_draft(self.state, target, device)


@torch.no_grad()
def draft_step_ms(draft: DFlashDraft, rows: list[PackedRow], device: str, repeats: int = 8) -> float:
    """Median wall time of one inference draft step (one block over real validation context)."""
    draft.eval()
    row = rows[0].to(device)
    context = int((row.document_ids == row.document_ids[0]).sum()) - 1
    timings = []
    for _ in range(repeats + 2):
        synchronize(device)
        started = time.perf_counter()
        draft.propose(row.features[:context], row.position_ids[:context], int(row.input_ids[context]), context)
        synchronize(device)
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


def default_run_name(config: RunConfig) -> str:
    return f"{config.algorithm.algorithm}-{config.fingerprint()}"


class LossWatch:
    """The loss, watched on the device: a non-finite value and an all-zero run are recorded there each step
    and read by the host only at `check` (log, validation, save), so a step never waits for the device."""

    def __init__(self, device: str) -> None:
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0: none yet
        self.bad_value = torch.zeros((), device=device)
        self.any_nonzero = torch.zeros((), dtype=torch.bool, device=device)
        self.loss = torch.zeros((), device=device)
        self.last_loss = float("nan")

    def record(self, step: int, loss: torch.Tensor) -> None:
        """`loss`: this rank's part of the step's loss (the whole loss in one process)."""
        bad = ~torch.isfinite(loss) & (self.first_bad_step == 0)
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)
        self.bad_value = torch.where(bad, loss.float(), self.bad_value)
        self.any_nonzero |= loss != 0
        self.loss = loss

    def check(self, checkpoint: Path, ranks: Ranks = SINGLE) -> None:
        """Raise on a non-finite loss since the last check (on any rank, so all ranks stop together), before
        anything is logged or saved."""
        state = [self.first_bad_step, self.bad_value, self.any_nonzero, self.loss]
        per_rank = [s.tolist() for s in ranks.gather(torch.stack([t.double() for t in state]).cpu())]
        bad = [(step, value) for step, value, *_ in per_rank if step]
        self.any_nonzero.fill_(any(nonzero for _, _, nonzero, _ in per_rank))
        self.last_loss = sum(loss for *_, loss in per_rank)  # the ranks' weighted parts of the batch's loss
        if bad:
            step, value = min(bad)
            raise NonFiniteLoss(
                f"non-finite loss {value} at step {int(step)}; last good checkpoint kept at {checkpoint}"
            )

    def all_zero(self, first: int, last: int) -> bool:
        return last > first and not bool(self.any_nonzero)


def rank_part(draft: DFlashDraft, row: PackedRow, anchors: Anchors, ranks: Ranks) -> tuple[Anchors, float]:
    """This rank's every-world_size-th anchors of a batch (host tensors) and its share of the batch's loss."""
    if not ranks.distributed:
        return anchors, 1.0
    part = anchors.strided(ranks.rank, ranks.world_size)
    return part, draft.batch_share(row, anchors, part)


def optimizer_step(
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    share: float,
    ranks: Ranks,
    clip: float,
) -> torch.Tensor:
    """Backward this rank's share of the batch's loss, clip and step; returns the gradient norm (on the device).
    FSDP averages the ranks' gradients, so each rank's part is scaled by the world size to make them a sum."""
    optimizer.zero_grad(set_to_none=True)
    (loss * (share * ranks.world_size)).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), clip)
    optimizer.step()
    return grad_norm


# Called after each validation with (step, metrics); a returned string stops the run as pruned.
ValidationHook = Callable[[int, dict[str, float]], str | None]


class TrainingRecipe:
    """One draft's training, in the torchtune manner: setup, resume, step, validate, save.

    The recipe owns the model, optimizer and schedule; the `Run` owns the directory and MLflow.
    """

    def __init__(
        self, config: RunConfig, workspace: Workspace, run: Run, device: str = "cpu", ranks: Ranks = SINGLE
    ) -> None:
        self.config, self.workspace, self.run, self.device, self.ranks = config, workspace, run, device, ranks
        self.shared = config.algorithm.shared
        self.start_step = 0
        self.history: list[dict] = []
        self.pending_metrics: list[tuple[dict[str, float], str, int]] = []
        self.unflushed: list[tuple[dict[str, float], str, int]] = []
        self.setup()

    def setup(self) -> None:
        """A fresh draft (sharded over the ranks), optimizer, schedule and anchor stream, all seeded by the
        training seed: every rank starts from the same weights. Under torchrun each rank also keeps an unsharded
        replica, refreshed before each validation, which validation and inference run on."""
        train = self.config.train
        torch.manual_seed(train.seed)
        draft = build_for_target(self.config, self.workspace.target)
        if train.init_from:
            warm_start(draft, Path(train.init_from))
        draft = draft.to(self.device)
        self.replica = draft
        if self.ranks.distributed:
            with torch.random.fork_rng(devices=[]):
                self.replica = build_for_target(self.config, self.workspace.target).to(self.device)
            self.replica.embed_weight, self.replica.head_weight = draft.embed_weight, draft.head_weight  # frozen
        self.draft = shard(draft, self.ranks, uses_bf16(self.device, train.precision))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.draft.parameters() if p.requires_grad],
            lr=train.learning_rate,
            weight_decay=train.weight_decay,
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: learning_rate_factor(
                step, train.max_steps, train.warmup_ratio, train.schedule, train.decay_ratio
            ),
        )
        self.anchor_generator = generator("cpu", train.seed)  # anchors are drawn on the host, like the rows
        # WSD: where each branch's decay starts, a checkpoint of the stable stretch is kept for it
        self.stable_steps = {budget - decay_steps(budget, train.decay_ratio) for budget in train.branches}
        self.branched_at: int | None = None
        self.watch = LossWatch(self.device)
        self.tokens_since_log: tuple[int, int] = (0, 0)
        self.grad_norm = torch.zeros((), device=self.device)
        self.skipped_since_log = 0

    def resume(self) -> None:
        """Continue from the run's checkpoint, which must come from the same config; any world size may
        resume it (rank 0 reads it and hands every rank its part)."""
        state = self.restore(self.run.load_checkpoint() if self.ranks.is_main else {}, self.config_change)
        self.run.run_id = state["run_id"]  # every rank's result names the run
        self.unflushed = [entry for entry in state.get("pending_metrics", []) if entry[0]]
        log.info("resuming %s at step %d (MLflow run %s)", self.run.name, self.start_step, self.run.run_id)

    def restore(self, state: dict, mismatch: Callable[[dict], str | None]) -> dict:
        """Rank 0's checkpoint `state`, refused with `mismatch`'s one-line reason if it has one, into every rank's
        draft, optimizer, schedule and anchor stream; returns the rest of it, which every rank receives."""
        error = self.ranks.from_main(mismatch(state) if self.ranks.is_main else None)
        if error:
            raise ValueError(error)
        load_full_state(self.draft, self.optimizer, state.get("model", {}), state.get("optimizer", {}), self.ranks)
        state = self.ranks.from_main({k: v for k, v in state.items() if k not in ("model", "optimizer")})
        self.schedule.load_state_dict(state["scheduler"])
        self.anchor_generator.set_state(state["anchor_generator"])
        self.start_step, self.history = state["step"], state["history"]
        return state

    def branch(self) -> None:
        """Start a WSD branch from its parent run's stable checkpoint at the step where this budget's decay begins:
        same weights, optimizer state, anchor stream and row order, and from there this run's own decay."""
        train = self.config.train
        start = train.max_steps - decay_steps(train.max_steps, train.decay_ratio)
        parent = Run(self.run.workdir, train.branch_of)
        path = parent.stable_checkpoint_path(start)
        if self.ranks.is_main and not path.exists():
            raise FileNotFoundError(
                f"invalid --branch-of={train.branch_of!r}: no stable checkpoint at step {start} ({path}); allowed a "
                f"wsd run that listed {train.max_steps} in its branches and trained past step {start}"
            )
        # the scheduler's state carries the step; the factor from there on is this run's own schedule
        state = parent.load_checkpoint(path) if self.ranks.is_main else {}
        self.branched_at = self.restore(state, self.branch_change)["step"]
        log.info("branching %s from %s at step %d: decay to %d", self.run.name, parent.name, start, train.max_steps)

    def branch_change(self, state: dict) -> str | None:
        """Why the parent's config differs from this branch's in more than the budget and the lineage, or None."""
        parent = RunConfig.from_dict(state["config"])
        lineage = dict(branches=[], branch_of=None, max_steps=parent.train.max_steps)
        current = dataclasses.replace(
            self.config, train=dataclasses.replace(self.config.train, **lineage)
        ).flat_params()
        stored = dataclasses.replace(parent, train=dataclasses.replace(parent.train, **lineage)).flat_params()
        if current == stored:
            return None
        first = sorted(k for k, v in current.items() if stored.get(k) != v)[0]
        return (
            f"invalid --branch-of={self.config.train.branch_of!r}: {first}={current.get(first)!r}, but that run "
            f"trained with {stored.get(first)!r}; a branch keeps every knob but max_steps"
        )

    def config_change(self, state: dict) -> str | None:
        """Why a checkpoint's config does not match this run's, or None (a knob added since it was saved reads
        its default there)."""
        if state["config"] == self.config.to_dict():
            return None
        stored, current = RunConfig.from_dict(state["config"]).flat_params(), self.config.flat_params()
        changed = sorted(k for k, v in current.items() if stored.get(k) != v)
        if not changed:
            return None
        first = changed[0]
        return (
            f"invalid --resume of {self.run.name!r}: {first}={current.get(first)!r}, but its checkpoint was "
            f"trained with {stored.get(first)!r} (changed: {changed}); allowed the same config, or another --run-name"
        )

    def save(self, step: int) -> None:
        """Checkpoint, then the metrics logged up to it. The checkpoint carries them too: a kill between
        the two leaves them to the resume (`log_unflushed`), which logs only those MLflow lacks.
        Under torchrun every rank gathers its shards to rank 0, which alone writes (one world-size-free file)."""
        state = self.checkpoint_state(step)
        if not self.ranks.is_main:
            return
        self.run.save_checkpoint(state)
        self.flush_metrics()

    def save_stable(self, step: int) -> None:
        """A WSD run's checkpoint of its stable stretch at `step`, kept for the branch that starts there."""
        state = self.checkpoint_state(step)
        if self.ranks.is_main:
            self.run.save_checkpoint({**state, "pending_metrics": []}, self.run.stable_checkpoint_path(step))

    def checkpoint_state(self, step: int) -> dict:
        """Everything a resume (or a branch) continues from; every rank gathers its shards, rank 0 gets them."""
        model, optimizer = full_state(self.draft, self.optimizer, self.ranks)
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.schedule.state_dict(),
            "anchor_generator": self.anchor_generator.get_state(),
            "step": step,
            "history": self.history,
            "run_id": self.run.run_id,
            "config": self.config.to_dict(),
            "pending_metrics": self.pending_metrics,
        }

    def log_unflushed(self) -> None:
        """The resumed checkpoint's metrics that never reached MLflow (one batch is logged whole or not at all)."""
        client = tracking.client(self.run.workdir)
        for values, prefix, step in self.unflushed:
            key = tracking.metric_key(next(iter(values)), prefix)  # as logged: curve/realized, accept/unary
            if step not in {m.step for m in client.get_metric_history(self.run.run_id, key)}:
                self.run.log_metrics(values, prefix, step)
        self.unflushed = []

    def training_row(self, step: int) -> PackedRow:
        """Rows in a seeded random order per epoch, so a resumed run sees the same sequence (on the host)."""
        rows = self.workspace.train_rows
        epoch, position = divmod(step, len(rows))
        seed = self.config.train.seed * 100003 + epoch
        order = torch.randperm(len(rows), generator=generator("cpu", seed))
        return self.workspace.training_row(int(order[position]))

    def step(self, step: int) -> StepOutput:
        """One optimizer step that never waits for the device: the row and its anchors are drawn on the host and
        moved once (with the anchors' host view, which slices the attention tiles); the loss, grad norm and
        metric counts stay on the device until `check` reads them.

        Every rank draws the same row and anchors and trains on its own every-world_size-th anchors, with its
        loss weighted by its share of the batch's supervised positions: the ranks' gradients (which FSDP
        averages) add up to the one-process gradient of the whole batch, and so do their metric counts.

        A micro-batch with no supervised slot teaches nothing, and AdamW's momentum and weight decay would still
        move the weights on it: its optimizer step is skipped (on every rank alike, since they all hold the same
        batch) and counted in `train/skipped_steps`; the schedule still advances, so the LR follows the step."""
        row = self.training_row(step)
        anchors = sample_anchors(
            row.loss_mask, row.document_ids, self.shared.block_size, self.shared.max_anchors, self.anchor_generator
        )
        if not bool(self.replica.supervision(row, anchors).any()):
            log.info("step %d: no supervised slot in the micro-batch; optimizer step skipped", step + 1)
            self.skipped_since_log += 1
            self.schedule.step()
            return StepOutput(torch.zeros((), device=self.device), {})
        draft_tokens, feature_tokens = self.tokens_since_log
        self.tokens_since_log = (
            draft_tokens + int(anchors.valid.sum()) * self.shared.block_size,
            feature_tokens + row.length,
        )
        anchors, share = rank_part(self.replica, row, anchors, self.ranks)
        row, anchors = to_device(row, anchors, self.device)
        for draft in {id(d): d for d in (self.draft, self.replica)}.values():  # validation runs on the replica
            draft.set_training_progress(step, self.config.train.max_steps)
        with autocast(self.device, self.config.train.precision):
            output = self.draft.training_forward(row, anchors)
        self.watch.record(step + 1, output.loss.detach() * share)
        self.grad_norm = optimizer_step(
            self.draft, self.optimizer, output.loss, share, self.ranks, self.config.train.grad_clip
        )
        self.schedule.step()
        return output

    def step_stats(self) -> dict[str, float]:
        """Throughput since the last log (its wall time includes the device's queue) and the optimizer state."""
        elapsed = time.perf_counter() - self.logged_at
        draft_tokens, feature_tokens = self.tokens_since_log
        self.tokens_since_log, self.logged_at = (0, 0), time.perf_counter()
        skipped, self.skipped_since_log = self.skipped_since_log, 0
        return {
            "lr": self.schedule.get_last_lr()[0],
            "grad_norm": plain_number(self.grad_norm),
            SKIPPED_STEPS: skipped,
            "draft_tokens_per_s": draft_tokens / elapsed,
            "target_feature_tokens_per_s": feature_tokens / elapsed,
        }

    def validate(self, step: int) -> dict[str, float]:
        """The fixed subset of anchors before the last step; every anchor of every document at the last one,
        whose per-document pairs are kept for the intervals (`val/num_anchors` says which set each step used)."""
        train, workspace, ranks = self.config.train, self.workspace, self.ranks
        draft = unsharded_copy(self.draft, self.replica, ranks)
        # The subset runs at every validation, the last included: the learning curve stays on one anchor set.
        subset = validate_subset(draft, workspace.validation_rows, self.device, train.precision, ranks)
        self.log_metrics(curve_values(subset.values), tracking.CURVE_PREFIX, step)
        if step < train.max_steps:
            validation = subset
        else:
            started = time.perf_counter()
            validation = validate_documents(
                draft, workspace.validation_documents, self.device, train.precision, train.final_validation_cap, ranks
            )
            validation.values[FINAL_VALIDATION_S] = time.perf_counter() - started  # its cost, visible in the UI
            self.write_documents(validation)
        self.log_metrics(validation.values, tracking.VAL_PREFIX, step)
        self.history.append({"step": step, **validation.values})
        return validation.values

    def write_documents(self, validation: Validation) -> None:
        if self.ranks.is_main:
            atomic_write(
                self.run.path(VALIDATION_DOCUMENTS_FILE), lambda tmp: validation.documents.to_csv(tmp, index=False)
            )

    def log_metrics(self, values: dict[str, float], prefix: str, step: int) -> None:
        """Held until the next checkpoint: MLflow never holds a step that a resume would log again."""
        self.pending_metrics.append((values, prefix, step))

    def flush_metrics(self) -> None:
        if not self.ranks.is_main:  # the same values on every rank; rank 0 owns the MLflow run
            self.pending_metrics = []
            return
        for values, prefix, step in self.pending_metrics:
            self.run.log_metrics(values, prefix, step)
        self.pending_metrics = []

    def log_start(self) -> None:
        """What a run records when it starts: config, params (rank 0) and the validation of its first weights
        (untrained at step 0; a branch's stable checkpoint at the step it starts from)."""
        if self.ranks.is_main:
            self.log_config()
        self.validate(self.start_step)

    def log_config(self) -> None:
        workspace, config_path = self.workspace, self.run.path(CONFIG_FILE)
        config_path.write_text(json.dumps(self.config.to_dict(), indent=2))
        self.run.log_params(
            {
                **self.config.flat_params(),
                **workspace.target.identity(workspace.workdir),
                "dataset": workspace.data.dataset_id,
                "dataset_hash": workspace.data.dataset_hash,
                "decontaminated_conversations": workspace.data.decontaminated,
                "mask_token_reason": workspace.target.mask_token_reason,
                "draft_parameters": sum(p.numel() for p in self.draft.parameters()),
                "device": self.device,
            }
        )
        self.run.log_file(config_path)
        self.run.log_datasets(
            workspace.data.dataset_id, workspace.data.dataset_hash, workspace.workdir / "data", ("train", "validation")
        )

    def train(self, on_validation: ValidationHook | None = None) -> TrainResult:
        """Steps from the start (or the checkpoint) to max_steps, validating, logging and saving on schedule.

        The host reads the device only where it logs, validates or saves; a non-finite loss is caught there,
        before any checkpoint could hold it."""
        train, steps = self.config.train, self.config.train.max_steps
        counts: MetricCounts = {}
        validation = self.history[-1] if self.history else {}
        bar = tqdm(
            range(self.start_step, steps),
            initial=self.start_step,
            total=steps,
            desc=f"train {self.run.name}",
            disable=not self.ranks.is_main,
        )
        self.logged_at = time.perf_counter()
        for step in bar:
            output = self.step(step)
            pool(counts, output.counts)
            done = step + 1
            logging_now = done % train.log_every == 0 or done == steps
            validating = done % train.eval_every == 0 or done == steps
            saving = done % train.checkpoint_every == 0 or done == steps
            if logging_now or validating or saving:
                self.watch.check(self.run.checkpoint_path, self.ranks)
                bar.set_postfix(
                    loss=f"{self.watch.last_loss:.3f}",
                    val_realized=f"{validation.get(REALIZED_ACCEPTED_LENGTH, 0):.3f}",
                )
            if logging_now:
                metrics = {
                    **finalize(self.pooled_over_ranks(counts), self.shared.block_size, self.shared.first_draft_slot),
                    **self.step_stats(),
                }
                self.log_metrics(metrics, tracking.TRAIN_PREFIX, done)
                counts = {}
            if validating:
                validation = self.validate(done)
                log.info(
                    "step %d: val realized %.3f unary %.3f oracle %.3f",
                    done,
                    *(
                        validation[name]
                        for name in (REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH, ORACLE_ACCEPTED_LENGTH)
                    ),
                )
                stop = on_validation(done, validation) if on_validation is not None and self.ranks.is_main else None
                stop = self.ranks.from_main(stop)
                if stop:
                    bar.close()
                    self.flush_metrics()
                    return self.result(validation, stopped_reason=stop)
            if saving:
                self.save(done)
            if done in self.stable_steps:
                self.save_stable(done)
        bar.close()
        if self.watch.all_zero(self.start_step, steps):
            raise DegenerateRun(
                f"the loss was exactly 0 at every step ({self.start_step + 1}..{steps}): nothing was learned; "
                "check that the data has supervised (assistant) tokens"
            )
        return self.result(validation)

    def pooled_over_ranks(self, counts: MetricCounts) -> MetricCounts:
        """Every rank's (sum, total) pairs added up, in one collective: the counts of the whole batch."""
        if not self.ranks.distributed or not counts:
            return counts
        summed = self.ranks.sum_(torch.stack(list(counts.values())))
        return dict(zip(counts, summed, strict=True))

    def result(self, validation: dict[str, float], stopped_reason: str | None = None) -> TrainResult:
        """The result holds the unsharded draft as of the last validation (the final weights after the last)."""
        return TrainResult(
            self.run.run_id, self.run.directory, validation, self.history, self.replica, stopped_reason=stopped_reason
        )

    def log_finish(self, result: TrainResult) -> None:
        """Inference step time, the final validation's per-document pairs and per-position CSV, the checkpoint."""
        step_ms = draft_step_ms(result.draft, self.workspace.validation_rows, self.device)
        result.validation[DRAFT_STEP_MS] = step_ms
        self.run.log_metrics({DRAFT_STEP_MS: step_ms}, tracking.VAL_PREFIX, self.config.train.max_steps)
        documents = self.run.path(VALIDATION_DOCUMENTS_FILE)  # on disk: a resume after the last save has it too
        counts = pooled_counts(pd.read_csv(documents))
        rows = per_position_rows(counts)
        csv = self.run.path(PER_POSITION_FILE)
        pd.DataFrame(rows).to_csv(csv, index=False)
        self.run.log_file(documents)
        self.run.log_file(csv)
        self.run.log_figure(per_position_figure(rows, self.run.name), PER_POSITION_FIGURE)
        self.run.describe(summary_line(result.validation))
        self.run.log_checkpoint()
        self.log_export(result.draft)

    def log_export(self, draft: DFlashDraft) -> None:
        """The final draft exported in its peer layout and logged with the run; a member without one (no peer
        serves it) keeps only its checkpoint."""
        try:
            peer_format(self.config.algorithm.entry)
        except NoPeerFormat as why:
            log.info("no export logged for %s: %s", self.run.name, why)
            return
        export_dir = self.run.path(EXPORT_DIR)
        export_checkpoint(draft, export_dir, self.workspace.target.source)
        self.run.log_export(export_dir)


def train(
    config: RunConfig,
    workspace: Workspace,
    *,
    run_name: str | None = None,
    resume: bool = False,
    device: str = "cpu",
    tags: dict[str, str] | None = None,
    parent_run_id: str | None = None,
    on_validation: ValidationHook | None = None,
    experiment: str = tracking.DEFAULT_EXPERIMENT,
    system_metrics: bool = False,
    ranks: Ranks = SINGLE,
) -> TrainResult:
    """Train one draft in its own run. `on_validation` may stop it early (a pruned trial).

    Under torchrun every rank calls this; rank 0 alone owns the run directory and the MLflow run."""
    config = with_target_defaults(config, workspace.target)
    config.validate()
    if config.algorithm.shared.max_anchors < ranks.world_size:
        raise ValueError(
            f"invalid --max-anchors={config.algorithm.shared.max_anchors}: allowed at least the number of ranks "
            f"({ranks.world_size}), which split each batch's anchors"
        )
    if not any(bool(row.loss_mask.any()) for row in workspace.train_rows):
        raise ValueError(
            f"invalid --data={config.data.dataset!r}: the training set has no supervised (assistant) tokens; "
            "allowed conversations with assistant turns"
        )
    block_size = config.algorithm.shared.block_size
    if not any(
        bool(eligible_anchor_mask(d.loss_mask, d.document_ids, block_size).any())
        for d in workspace.validation_documents
    ):
        raise ValueError(
            f"invalid --data={config.data.dataset!r}: no validation anchors (no assistant token of a validation "
            f"document is followed by {block_size - 1} more tokens of its document, as a block of {block_size} "
            "needs); allowed conversations with longer assistant turns"
        )
    run = Run(workspace.workdir, run_name or default_run_name(config), experiment, system_metrics=system_metrics)
    held = run.hold() if ranks.is_main else True
    if not ranks.from_main(held):
        raise RunInUse(
            f"run {run.name!r} is being trained by another process right now ({run.directory}); wait for it to "
            "end, or choose another --run-name"
        )
    try:
        return _train_held(config, workspace, run, resume, device, ranks, tags, parent_run_id, on_validation)
    finally:
        run.release()


def _train_held(
    config: RunConfig,
    workspace: Workspace,
    run: Run,
    resume: bool,
    device: str,
    ranks: Ranks,
    tags: dict[str, str] | None,
    parent_run_id: str | None,
    on_validation: ValidationHook | None,
) -> TrainResult:
    """`train` once this process holds the run."""
    found = (run.exists(), run.has_checkpoint(), resume and run.lost_checkpoint()) if ranks.is_main else None
    started = ranks.from_main(found)
    if started[0] and not resume:
        raise FileExistsError(
            f"{run.directory} already holds a run; pass --resume to continue it or choose another --run-name"
        )
    if started[2]:  # restarting at step 0 would log a second history into the same MLflow run
        raise FileNotFoundError(
            f"{run.checkpoint_path} is missing but its MLflow run already holds metrics: --resume cannot continue "
            "it without a second history; restore the checkpoint or train under a new --run-name"
        )
    recipe = TrainingRecipe(config, workspace, run, device, ranks)
    if started[1]:
        recipe.resume()
    else:
        if config.train.branch_of:
            recipe.branch()
        if started[0] and ranks.is_main:  # killed before its first checkpoint: the same MLflow run starts again
            run.run_id = run.recorded_run_id()
    run_tags = {
        tracking.TAG_ALGORITHM: config.algorithm.algorithm,
        tracking.TAG_ROLE: tracking.ROLE_RUN,
        **(tags or {}),
    }
    with run.active(run_tags, parent_run_id) if ranks.is_main else nullcontext():
        if ranks.is_main:
            run.tag_start(ranks.world_size, computes_in(device, config.train.precision))
        if recipe.start_step == 0 or recipe.branched_at is not None:
            recipe.log_start()
        elif ranks.is_main:
            recipe.log_unflushed()
        result = recipe.train(on_validation)
        if not ranks.is_main:
            return result
        if result.stopped_reason:
            run.end(RunStatus.PRUNED, result.stopped_reason)
        else:
            recipe.log_finish(result)
    return result
