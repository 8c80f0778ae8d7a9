"""Every knob of a draft algorithm: one dataclass per scope, validated with clear errors.

`SharedKnobs` holds what DFlash and DFlash2 share, so a comparison can pin it once.
Each algorithm adds its own knobs dataclass. `AlgorithmConfig` bundles both and
round-trips through plain dicts so the harness can log and rebuild any run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

LOSS_NAMES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")
POSITION_WEIGHTINGS = ("fixed-exp-decay", "dpace")
BLOCK_ATTENTIONS = ("bidirectional", "causal")
SELECTOR_INITS = ("zero_successor", "normal")


def knob_error(knob: str, value: Any, allowed: str) -> ValueError:
    """The one error shape for a bad knob: its name, its value and what is allowed."""
    return ValueError(f"invalid knob {knob}={value!r}: allowed {allowed}")


def parse_loss_spec(loss: str | dict[str, float]) -> dict[str, float]:
    """A loss name or a JSON/dict of {name: weight} -> validated {name: weight}."""
    if isinstance(loss, str):
        if loss in LOSS_NAMES:
            return {loss: 1.0}
        try:
            loss = json.loads(loss)
        except json.JSONDecodeError:
            raise knob_error("loss", loss, f"one of {list(LOSS_NAMES)} or a JSON dict of weights") from None
    if not isinstance(loss, dict) or not loss:
        raise knob_error("loss", loss, "a non-empty dict of {loss name: weight}")
    weights: dict[str, float] = {}
    for name, weight in loss.items():
        if name not in LOSS_NAMES:
            raise knob_error("loss", name, f"terms from {list(LOSS_NAMES)}")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            raise knob_error(f"loss[{name}]", weight, "a number")
        weights[name] = float(weight)
    return weights


@dataclass
class SharedKnobs:
    """Knobs that affect DFlash and DFlash2 alike; pin them identically when comparing."""

    # shape
    block_size: int = 8
    num_draft_layers: int = 5
    # speculators aux ids: hidden_states[i] of the target; None -> [2, n//2, n-3]
    target_layer_ids: list[int] | None = None
    # prediction
    sample_from_anchor: bool = False
    block_attention: str = "bidirectional"
    mask_token_id: int | None = None
    # loss
    loss: str | dict[str, float] = "kl_div"
    position_weighting: str = "fixed-exp-decay"
    decay_gamma: float = 4.0
    dpace_alpha: float = 0.5
    max_anchors: int = 512
    sliding_window: int = 2048
    draft_vocab_size: int | None = None  # None: the full verifier vocabulary

    @property
    def loss_weights(self) -> dict[str, float]:
        return parse_loss_spec(self.loss)

    @property
    def first_draft_slot(self) -> int:
        """Slot 0 is the verified anchor unless the draft also predicts from it."""
        return 0 if self.sample_from_anchor else 1

    def validate(self) -> None:
        if self.block_size < 2:
            raise knob_error("block_size", self.block_size, "an integer >= 2")
        if self.num_draft_layers < 1:
            raise knob_error("num_draft_layers", self.num_draft_layers, "an integer >= 1")
        if self.block_attention not in BLOCK_ATTENTIONS:
            raise knob_error("block_attention", self.block_attention, f"one of {list(BLOCK_ATTENTIONS)}")
        if self.position_weighting not in POSITION_WEIGHTINGS:
            raise knob_error("position_weighting", self.position_weighting, f"one of {list(POSITION_WEIGHTINGS)}")
        weights = self.loss_weights
        if self.position_weighting == "dpace" and list(weights) != ["ce"]:
            raise knob_error(
                "loss", self.loss, "exactly 'ce' when position_weighting='dpace' (D-PACE weights come from CE)"
            )
        if self.decay_gamma <= 0:
            raise knob_error("decay_gamma", self.decay_gamma, "a number > 0")
        if not 0 < self.dpace_alpha <= 1:
            raise knob_error("dpace_alpha", self.dpace_alpha, "a number in (0, 1]")
        if self.max_anchors < 1:
            raise knob_error("max_anchors", self.max_anchors, "an integer >= 1")
        if self.sliding_window < 1:
            raise knob_error("sliding_window", self.sliding_window, "an integer >= 1")
        if self.target_layer_ids is not None:
            ids = list(self.target_layer_ids)
            if not ids or ids != sorted(set(ids)):
                raise knob_error("target_layer_ids", self.target_layer_ids, "a non-empty, distinct, ascending list")

    def resolve_target_layer_ids(self, num_target_layers: int) -> list[int]:
        """The aux ids to use for a target with n layers; each must lie in [1, n-1]."""
        n = num_target_layers
        ids = list(self.target_layer_ids) if self.target_layer_ids is not None else [2, n // 2, n - 3]
        if not ids or ids != sorted(set(ids)) or ids[0] < 1 or ids[-1] > n - 1:
            raise knob_error(
                "target_layer_ids",
                ids,
                f"distinct ascending ids in [1, {n - 1}] for a target with {n} layers "
                "(id 0 is the embedding, id n is ambiguous post/pre final norm)",
            )
        return ids


@dataclass
class DFlashKnobs:
    """DFlash adds no model knobs; `metrics_top_k` only sets K for recall@K and the oracle path."""

    metrics_top_k: int = 16

    def validate(self, shared: SharedKnobs) -> None:
        if self.metrics_top_k < 1:
            raise knob_error("metrics_top_k", self.metrics_top_k, "an integer >= 1")

    @property
    def candidate_top_k(self) -> int:
        return self.metrics_top_k


@dataclass
class DFlash2Knobs:
    """Local dynamic grouped causal conv + low-rank candidate selector (spec §4)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0
    selector_init: str = "zero_successor"

    def validate(self, shared: SharedKnobs) -> None:
        if shared.sample_from_anchor:
            raise knob_error("sample_from_anchor", True, "False for dflash2 (the served block starts at the anchor)")
        if not 1 <= self.conv_kernel_size <= shared.block_size:
            raise knob_error(
                "conv_kernel_size", self.conv_kernel_size, f"an integer in [1, block_size={shared.block_size}]"
            )
        if self.conv_group_size < 1:
            raise knob_error("conv_group_size", self.conv_group_size, "an integer >= 1 that divides the hidden size")
        if self.selector_rank < 1:
            raise knob_error("selector_rank", self.selector_rank, "an integer >= 1")
        if self.selector_top_k < 1:
            raise knob_error("selector_top_k", self.selector_top_k, "an integer in [1, vocab_size]")
        if self.selector_loss_alpha < 0:
            raise knob_error("selector_loss_alpha", self.selector_loss_alpha, "a number >= 0")
        if self.selector_init not in SELECTOR_INITS:
            raise knob_error("selector_init", self.selector_init, f"one of {list(SELECTOR_INITS)}")

    @property
    def candidate_top_k(self) -> int:
        return self.selector_top_k


ALGORITHM_KNOBS: dict[str, type] = {"dflash": DFlashKnobs, "dflash2": DFlash2Knobs}


def preset_shared_knobs(algorithm: str) -> SharedKnobs:
    """Published defaults (spec §7): the shared knobs differ per algorithm, and are recorded."""
    if algorithm == "dflash":
        return SharedKnobs(block_size=16, loss="ce", position_weighting="dpace")
    if algorithm == "dflash2":
        return SharedKnobs(block_size=8, loss="kl_div", position_weighting="fixed-exp-decay")
    raise knob_error("algorithm", algorithm, f"one of {sorted(ALGORITHM_KNOBS)}")


@dataclass
class AlgorithmConfig:
    """An algorithm name with its shared and algorithm-specific knobs."""

    algorithm: str
    shared: SharedKnobs = field(default_factory=SharedKnobs)
    knobs: DFlashKnobs | DFlash2Knobs = field(default_factory=DFlashKnobs)

    @classmethod
    def preset(cls, algorithm: str, **overrides: Any) -> AlgorithmConfig:
        """The algorithm's published defaults, with flat overrides (shared or algorithm knobs)."""
        config = cls(algorithm, preset_shared_knobs(algorithm), ALGORITHM_KNOBS[algorithm]())
        return config.replace(**overrides)

    def replace(self, **overrides: Any) -> AlgorithmConfig:
        """A copy with flat knob overrides; an unknown name is an error, not a silent no-op."""
        shared_names = {f.name for f in dataclasses.fields(SharedKnobs)}
        algo_names = {f.name for f in dataclasses.fields(type(self.knobs))}
        unknown = set(overrides) - shared_names - algo_names
        if unknown:
            raise knob_error(
                "knob",
                sorted(unknown)[0],
                f"a knob of {self.algorithm}: {sorted(shared_names | algo_names)}",
            )
        shared = dataclasses.replace(self.shared, **{k: v for k, v in overrides.items() if k in shared_names})
        knobs = dataclasses.replace(self.knobs, **{k: v for k, v in overrides.items() if k in algo_names})
        return AlgorithmConfig(self.algorithm, shared, knobs)

    def validate(self) -> None:
        if self.algorithm not in ALGORITHM_KNOBS:
            raise knob_error("algorithm", self.algorithm, f"one of {sorted(ALGORITHM_KNOBS)}")
        if not isinstance(self.knobs, ALGORITHM_KNOBS[self.algorithm]):
            raise knob_error("knobs", type(self.knobs).__name__, ALGORITHM_KNOBS[self.algorithm].__name__)
        self.shared.validate()
        self.knobs.validate(self.shared)

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "shared": dataclasses.asdict(self.shared),
            "knobs": dataclasses.asdict(self.knobs),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlgorithmConfig:
        algorithm = data["algorithm"]
        if algorithm not in ALGORITHM_KNOBS:
            raise knob_error("algorithm", algorithm, f"one of {sorted(ALGORITHM_KNOBS)}")
        return cls(
            algorithm, SharedKnobs(**data.get("shared", {})), ALGORITHM_KNOBS[algorithm](**data.get("knobs", {}))
        )

    def flat_params(self) -> dict[str, Any]:
        """Flattened `shared.*` / `algo.*` names, as logged to MLflow."""
        params: dict[str, Any] = {"algorithm": self.algorithm}
        for prefix, section in (("shared", self.shared), ("algo", self.knobs)):
            for name, value in dataclasses.asdict(section).items():
                params[f"{prefix}.{name}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
        return params
