"""A run = algorithm knobs + training knobs + data knobs + target; one YAML/dict form for all of it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from algorithms import AlgorithmConfig
from algorithms.knobs import knob_error
from harness.data import DataConfig

OPTIMIZERS = ("adamw",)
SCHEDULES = ("linear", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """Optimisation knobs, recorded with every run like the algorithm knobs."""

    optimizer: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    warmup_ratio: float = 0.01
    schedule: str = "linear"
    max_steps: int = 300
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    log_every: int = 10
    checkpoint_every: int = 50
    precision: str = "auto"  # bf16 autocast on CUDA, fp32 on CPU; "bf16" also autocasts on CPU

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise knob_error("precision", self.precision, f"one of {list(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise knob_error("optimizer", self.optimizer, f"one of {list(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise knob_error("schedule", self.schedule, f"one of {list(SCHEDULES)}")
        if self.learning_rate <= 0:
            raise knob_error("learning_rate", self.learning_rate, "a number > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise knob_error("warmup_ratio", self.warmup_ratio, "a number in [0, 1)")
        for name in ("max_steps", "eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise knob_error(name, getattr(self, name), "an integer >= 1")
        if self.grad_clip <= 0:
            raise knob_error("grad_clip", self.grad_clip, "a number > 0")


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
            raise knob_error("config section", sorted(unknown)[0], f"one of {sorted(known)}")
        algorithm = AlgorithmConfig.from_dict({k: data[k] for k in ("algorithm", "shared", "knobs") if k in data})
        try:
            train = TrainConfig(**data.get("train", {}))
            data_config = DataConfig(**data.get("data", {}))
        except TypeError as error:
            raise ValueError(f"invalid config: {error}") from None
        return cls(algorithm, train, data_config, data.get("target", "smollm2-135m"))

    def flat_params(self) -> dict[str, Any]:
        params = self.algorithm.flat_params()
        for prefix, section in (("train", self.train), ("data", self.data)):
            for name, value in dataclasses.asdict(section).items():
                params[f"{prefix}.{name}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
        return params

    def fingerprint(self) -> str:
        from harness.data import stable_hash

        return stable_hash(self.to_dict())


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
