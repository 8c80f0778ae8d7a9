"""A run = algorithm knobs + training knobs + data knobs + target; one YAML/dict form for all of it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from algorithms import AlgorithmConfig
from algorithms.knobs import build_section, check_section, flat_section, knob, knob_error
from harness.data import DataConfig
from harness.features import DEVICE_PRECISION, FEATURE_PRECISIONS

OPTIMIZERS = ("adamw",)
SCHEDULES = ("linear", "cosine", "wsd")
PRECISIONS = ("auto", "fp32", "bf16")
CACHE_FEATURES, ONLINE_FEATURES = "cache", "online"
CONFIG_SECTION = "config section"  # the knob name of an unknown top-level key, which only a config file can set
FEATURE_MODES = (CACHE_FEATURES, ONLINE_FEATURES)


@dataclass
class TrainConfig:
    """Optimisation knobs, recorded with every run like the algorithm knobs."""

    # What a study may sweep (the budget and seed are the study's own; the rest say how a run is logged)
    SWEEPABLE: ClassVar[tuple[str, ...]] = (
        "learning_rate",
        "weight_decay",
        "warmup_ratio",
        "schedule",
        "decay_ratio",
        "grad_clip",
    )

    optimizer: str = knob("adamw", "optimizer", choices=OPTIMIZERS)
    learning_rate: float = knob(1e-3, "peak learning rate", flag="--lr")
    weight_decay: float = knob(0.01, "AdamW weight decay")
    warmup_ratio: float = knob(0.01, "share of the steps spent in linear warmup")
    schedule: str = knob(
        "linear", "after warmup: linear or cosine decay to 0, or wsd (constant, then a linear decay)", choices=SCHEDULES
    )
    decay_ratio: float = knob(0.15, "wsd: the share of the steps in the final decay to 0")
    branches: list[int] = knob(
        [],
        "wsd: shorter budgets to branch from this run: a checkpoint of the stable stretch is kept where each "
        "budget's decay starts, and `train --branch-of RUN --max-steps B` anneals it to B",
    )
    init_from: str | None = knob(
        None,
        "an export directory (ours, or a released draft of the same shape) whose weights start this run; the "
        "optimizer and schedule start fresh",
    )
    branch_of: str | None = knob(
        None, "the wsd run this one branches from: it starts from that run's stable checkpoint and decays to max_steps"
    )
    max_steps: int = knob(300, "optimizer steps")
    grad_clip: float = knob(1.0, "gradient norm clip")
    seed: int = knob(0, "seed of the init, the anchors and the row order")
    eval_every: int = knob(50, "steps between validations")
    log_every: int = knob(10, "steps between training-metric logs")
    checkpoint_every: int = knob(50, "steps between checkpoints")
    final_validation_cap: int = knob(
        0, "most anchors per validation document in the final validation (0: every eligible anchor)"
    )
    features: str = knob(
        CACHE_FEATURES,
        "cache: target features extracted once to disk; online: the target computes them in each step (no disk)",
        choices=FEATURE_MODES,
    )
    precision: str = knob(
        "auto",
        "auto: bf16 autocast on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else fp32",
        choices=PRECISIONS,
    )
    feature_precision: str = knob(
        DEVICE_PRECISION,
        "what the frozen target computes features in; device: bf16 on an accelerator, fp32 on every CPU (one cache "
        "for every CPU); auto: bf16 also on CPUs with native bf16 (faster there; within "
        "harness.features.BF16_FEATURE_TOLERANCE of fp32); bf16; fp32",
        choices=FEATURE_PRECISIONS,
    )

    def validate(self) -> None:
        check_section(self)
        if self.learning_rate <= 0:
            raise knob_error("learning_rate", self.learning_rate, "a number > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise knob_error("warmup_ratio", self.warmup_ratio, "a number in [0, 1)")
        for name in ("max_steps", "eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise knob_error(name, getattr(self, name), "an integer >= 1")
        if self.final_validation_cap < 0:
            raise knob_error("final_validation_cap", self.final_validation_cap, "an integer >= 0 (0: every anchor)")
        if self.grad_clip <= 0:
            raise knob_error("grad_clip", self.grad_clip, "a number > 0")
        if self.weight_decay < 0:
            raise knob_error("weight_decay", self.weight_decay, "a number >= 0")
        self.validate_wsd()

    def validate_wsd(self) -> None:
        """WSD's knobs: a decay share in (0, 1); branches and branch_of only with it; each branch a shorter budget
        whose decay starts after this run's warmup."""
        if not 0 < self.decay_ratio < 1:
            raise knob_error("decay_ratio", self.decay_ratio, "a number in (0, 1)")
        if self.schedule != "wsd" and (self.branches or self.branch_of):
            name, value = ("branches", self.branches) if self.branches else ("branch_of", self.branch_of)
            raise knob_error(name, value, "only with schedule: wsd (whose stable stretch a branch starts from)")
        warmup = warmup_steps(self.max_steps, self.warmup_ratio)
        for budget in self.branches:
            start = budget - decay_steps(budget, self.decay_ratio)
            if not warmup <= start or not budget < self.max_steps:
                raise knob_error(
                    "branches",
                    self.branches,
                    f"budgets below max_steps={self.max_steps} whose decay starts after the warmup's {warmup} steps "
                    f"({budget} would start its decay at step {start})",
                )


def warmup_steps(total: int, warmup_ratio: float) -> int:
    return max(1, math.ceil(total * warmup_ratio)) if warmup_ratio > 0 else 0


def decay_steps(total: int, decay_ratio: float) -> int:
    """WSD's decay length at a budget of `total` steps; a branch for that budget starts at total - decay_steps."""
    return max(1, round(total * decay_ratio))


def learning_rate_factor(step: int, total: int, warmup_ratio: float, schedule: str, decay_ratio: float = 0.15) -> float:
    """Linear warmup, then linear or cosine decay to 0, or WSD: constant until the last `decay_ratio` of the steps,
    then linear to 0 (Hägele et al. 2024), so a checkpoint of the constant stretch can be annealed at any budget."""
    warmup = warmup_steps(total, warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = decay_steps(total, decay_ratio)
        return 1.0 if step < total - decay else max(0.0, (total - step) / decay)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 1 - progress) if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class EvalConfig:
    """Measured-acceptance settings; the one home of their defaults (CLI and study files read them here)."""

    num_prompts: int = 20
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0
    # A study's served objective serves each run in this many rounds of fresh launches (harness/serving/speed.py):
    # one costs a quarter of a compared serving (benchmarks/serving/SERVED_COST.md) and leaves launch and seed noise
    # together in a design's residual; two or more also measure the launch noise on its own.
    served_rounds: int = 1
    # A served objective serves the draft over the this-many tokens its training replies use most (its own head and
    # a d2t map, FR-Spec): 0.88x against 0.62x with the whole vocabulary (benchmarks/serving/SPEEDUP.md); None: the
    # whole vocabulary. The compared serving keeps the whole one, which the harness's decode proposes from.
    served_vocabulary: int | None = None
    # A served objective serves the draft with llama.cpp's confidence cut (--spec-draft-p-min): a cycle's draft ends
    # at its first token less confident than this, and a cycle with none decodes a plain token; 0: no cut.
    served_confidence_cut: float = 0.0
    # A served objective drafts at most this many tokens per cycle (llama.cpp's --spec-draft-n-max below the
    # block): a shorter draft decode and verify batch, so a cheaper cycle with a lower break-even; None: the block.
    served_draft_length: int | None = None
    # The compared serving also serves llama.cpp's n-gram types on the same prompts (four more launches and passes).
    ngram_peers: bool = False
    # A member with a confidence head (DSpark) sends the target only the draft prefix whose predicted
    # cumulative acceptance stays at or above this; 0 verifies every member's whole block, like for like.
    confidence_threshold: float = 0.0
    # A JSONL file of {"prompt": ...} decoded in place of MT-bench (its first `num_prompts`), e.g. a user's own
    # traffic; None: MT-bench first turns.
    prompts: str | None = None


@dataclass
class RunConfig:
    """Everything that defines one training run."""

    algorithm: AlgorithmConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: str = "smollm2-135m"

    def validate(self) -> None:
        self.algorithm.validate()
        self.train.validate()
        self.data.validate()

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            **self.algorithm.to_dict(),
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {"target", "algorithm", "shared", "knobs", "train", "data"}
        unknown = set(data) - known
        if unknown:
            raise knob_error(CONFIG_SECTION, sorted(unknown)[0], f"one of {sorted(known)}")
        algorithm = AlgorithmConfig.from_dict({k: data[k] for k in ("algorithm", "shared", "knobs") if k in data})
        train = build_section(TrainConfig, data.get("train", {}), "train")
        data_config = build_section(DataConfig, data.get("data", {}), "data")
        return cls(algorithm, train, data_config, data.get("target", "smollm2-135m"))

    def flat_params(self) -> dict[str, Any]:
        return {**self.algorithm.flat_params(), **flat_section("train", self.train), **flat_section("data", self.data)}

    def with_knobs(self, values: dict[str, Any]) -> RunConfig:
        """A copy with flat knob values, each routed to its section: training knobs by name, the data's sweepable
        ones by name, the rest to the algorithm (whose shared or own knob it must be)."""
        train_names = {f.name for f in dataclasses.fields(TrainConfig)}
        train = {k: v for k, v in values.items() if k in train_names}
        data = {k: v for k, v in values.items() if k in DataConfig.SWEEPABLE}
        algorithm = self.algorithm.replace(**{k: v for k, v in values.items() if k not in {*train, *data}})
        return dataclasses.replace(
            self,
            algorithm=algorithm,
            train=dataclasses.replace(self.train, **train),
            data=dataclasses.replace(self.data, **data),
        )

    def fingerprint(self) -> str:
        from harness.data import stable_hash

        return stable_hash(self.to_dict())


class DuplicateKey(yaml.MarkedYAMLError):
    """A mapping names one key twice: YAML would keep the last value without a word."""


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a duplicate key in any mapping, naming the key and both of its lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then an override is the point of merging
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                where = f"twice on line {line}" if seen[key] == line else f"on lines {seen[key]} and {line}"
                raise DuplicateKey(problem=f"duplicate key {key!r} {where}")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeyLoader.construct_mapping)


def parse_yaml(text: str, path: Path | str) -> Any:
    """YAML text -> data; a syntax error or a duplicate key is one line naming the file and the line(s)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKey as error:
        raise ValueError(f"{path}: not valid YAML: {error.problem}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None


def load_yaml(path: Path) -> dict[str, Any]:
    data = parse_yaml(Path(path).read_text(), path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def file_knobs(data: dict[str, Any]) -> set[str]:
    """The knob names a loaded run config sets, in any section (to say which errors came from the file)."""
    names = set(data)
    for values in data.values():
        if isinstance(values, dict):
            names |= set(values)
    return names
