"""Every knob of a draft algorithm: one dataclass per scope, validated with clear errors.

`SharedKnobs` holds what every algorithm shares, so a comparison can pin it once. The conv and the
selector each add a knobs dataclass; an algorithm's knobs combine the components it uses. Each field
carries its help text (and, where it differs from the field name, the speculators flag), so the CLI,
the study files and the MLflow params are all generated from these dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

LOSS_NAMES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")
POSITION_WEIGHTINGS = ("fixed-exp-decay", "dpace", "uniform")
BLOCK_ATTENTIONS = ("bidirectional", "causal")
SELECTOR_INITS = ("zero_successor", "normal")
DRAFT_INITS = ("random", "target")


class KnobError(ValueError):
    """A bad knob value; `knob` names it so a caller can say where it came from (a file, a flag)."""

    def __init__(self, knob: str, value: Any, allowed: str):
        super().__init__(f"invalid knob {knob}={value!r}: allowed {allowed}")
        self.knob = knob


def knob_error(knob: str, value: Any, allowed: str) -> KnobError:
    """The one error shape for a bad knob: its name, its value and what is allowed."""
    return KnobError(knob, value, allowed)


def knob(default: Any, help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that documents itself: help text, CLI flag and allowed values."""
    metadata = {"help": help, "flag": flag, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def type_name(hint: Any) -> str:
    """A type hint as a reader would write it: `an integer`, `a list of integers or none`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {type_name(typing.get_args(hint)[0]).split(' ', 1)[1]}s"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "none"}.get(
        hint, str(hint)
    )


def has_type(value: Any, hint: Any) -> bool:
    """Whether a loaded value fits a knob's type hint; a bool is never a number, an int is a float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(has_type(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        return isinstance(value, list) and all(has_type(v, typing.get_args(hint)[0]) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(has_type(k, key) and has_type(v, item) for k, v in value.items())
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def check_section(section: Any) -> None:
    """Checks every knob dataclass shares: each value has its field's type (YAML `true` is not a step count,
    `4.5` not an integer), choices hold, and no float knob is NaN or infinite."""
    hints = typing.get_type_hints(type(section))
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if not has_type(value, hints[item.name]):
            raise knob_error(item.name, value, type_name(hints[item.name]))
        choices = item.metadata.get("choices")
        if choices and value not in choices:
            raise knob_error(item.name, value, f"one of {list(choices)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise knob_error(item.name, value, "a finite number")


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
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
            raise knob_error(f"loss[{name}]", weight, "a finite number")
        weights[name] = float(weight)
    return weights


@dataclass
class SharedKnobs:
    """Knobs that affect every algorithm alike; pin them identically when comparing."""

    # What a study may sweep beside an algorithm's own knobs (every run of a trial pins them alike); the draft's
    # shape (block size, depth) among them. Not the target's layer ids, mask token or vocabulary: those are lists or
    # follow the target.
    SWEEPABLE: ClassVar[tuple[str, ...]] = (
        "block_size",
        "num_draft_layers",
        "sample_from_anchor",
        "block_attention",
        "loss",
        "position_weighting",
        "decay_gamma",
        "dpace_alpha",
        "max_anchors",
        "sliding_window",
        "candidate_top_k",
        "draft_init",
    )

    block_size: int = knob(8, "tokens per draft block, the anchor included")
    num_draft_layers: int = knob(5, "draft decoder layers", flag="--num-layers")
    target_layer_ids: list[int] | None = knob(
        None, "target hidden_states indices fed to the draft (speculators aux ids); none: [2, n//2, n-3]"
    )
    sample_from_anchor: bool = knob(False, "predict from the anchor slot too (DSpark style; no selector)")
    block_attention: str = knob("bidirectional", "attention inside a block", choices=BLOCK_ATTENTIONS)
    mask_token_id: int | None = knob(None, "token id filling the draft slots; none: chosen from the target")
    loss: str | dict[str, float] = knob(
        "kl_div", f"unary loss: one of {list(LOSS_NAMES)} or a JSON dict of weights", flag="--loss-fn"
    )
    position_weighting: str = knob(
        "fixed-exp-decay", "per-slot loss weights", flag="--per-position-loss-weight", choices=POSITION_WEIGHTINGS
    )
    decay_gamma: float = knob(4.0, "fixed-exp-decay gamma", flag="--dflash-decay-gamma")
    dpace_alpha: float = knob(0.5, "D-PACE alpha")
    max_anchors: int = knob(512, "anchored blocks sampled per packed row")
    sliding_window: int = knob(2048, "context positions a block may attend to")
    draft_vocab_size: int | None = knob(None, "none: the full verifier vocabulary")
    candidate_top_k: int = knob(
        16, "K of the unary candidate set: the selector's candidates, recall@K and the oracle path"
    )
    draft_init: str = knob(
        "random",
        "how the draft's layers start: random (normal, std 0.02), or target: copies of the target's layers from "
        "the one its last fed hidden state enters, with fc passing that hidden state through",
        choices=DRAFT_INITS,
    )

    @property
    def loss_weights(self) -> dict[str, float]:
        return parse_loss_spec(self.loss)

    @property
    def first_draft_slot(self) -> int:
        """Slot 0 is the verified anchor unless the draft also predicts from it."""
        return 0 if self.sample_from_anchor else 1

    @property
    def label_offset(self) -> int:
        """Slot k of anchor a is trained on token a + k + label_offset: a draft that predicts from the anchor slot
        shifts its labels by one."""
        return 1 if self.sample_from_anchor else 0

    def validate(self) -> None:
        check_section(self)
        for name in ("num_draft_layers", "max_anchors", "sliding_window", "candidate_top_k"):
            if getattr(self, name) < 1:
                raise knob_error(name, getattr(self, name), "an integer >= 1")
        if self.block_size < 2:
            raise knob_error("block_size", self.block_size, "an integer >= 2")
        weights = self.loss_weights
        if self.position_weighting == "dpace" and list(weights) != ["ce"]:
            raise knob_error(
                "loss", self.loss, "exactly 'ce' when position_weighting='dpace' (D-PACE weights come from CE)"
            )
        if self.decay_gamma <= 0:
            raise knob_error("decay_gamma", self.decay_gamma, "a number > 0")
        if not 0 < self.dpace_alpha <= 1:
            raise knob_error("dpace_alpha", self.dpace_alpha, "a number in (0, 1]")
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
    """Plain DFlash adds no knobs of its own."""

    TUNED: ClassVar[tuple[str, ...]] = ()

    def validate(self, shared: SharedKnobs) -> None:
        check_section(self)


@dataclass
class ConvKnobs(DFlashKnobs):
    """The local dynamic grouped causal conv around each attention and MLP sublayer."""

    TUNED: ClassVar[tuple[str, ...]] = ("conv_kernel_size", "conv_group_size")

    conv_kernel_size: int = knob(2, "conv taps over earlier slots of the same block (1: the slot itself)")
    conv_group_size: int = knob(16, "channels sharing one dynamic tap; must divide the hidden size")

    def validate(self, shared: SharedKnobs) -> None:
        super().validate(shared)
        if not 1 <= self.conv_kernel_size <= shared.block_size:
            raise knob_error(
                "conv_kernel_size", self.conv_kernel_size, f"an integer in [1, block_size={shared.block_size}]"
            )
        if self.conv_group_size < 1:
            raise knob_error("conv_group_size", self.conv_group_size, "an integer >= 1 that divides the hidden size")


@dataclass
class SelectorKnobs(DFlashKnobs):
    """The low-rank candidate selector and its share of the split objective."""

    TUNED: ClassVar[tuple[str, ...]] = ("selector_rank", "candidate_top_k", "selector_loss_alpha")

    selector_rank: int = knob(256, "rank R of the predecessor x successor transition")
    selector_loss_alpha: float = knob(1.0, "weight of the selector K-way cross-entropy in the loss")
    selector_init: str = knob("zero_successor", "zero_successor starts as a no-op selector", choices=SELECTOR_INITS)

    def validate(self, shared: SharedKnobs) -> None:
        super().validate(shared)
        if shared.sample_from_anchor:
            raise knob_error(
                "sample_from_anchor", True, "False with a selector (the served block starts at the anchor)"
            )
        if self.selector_rank < 1:
            raise knob_error("selector_rank", self.selector_rank, "an integer >= 1")
        if self.selector_loss_alpha < 0:
            raise knob_error("selector_loss_alpha", self.selector_loss_alpha, "a number >= 0")


@dataclass
class DominoKnobs(DFlashKnobs):
    """Domino's correction head: GRU over the block's previous tokens, low-rank logit delta, base-loss schedule."""

    TUNED: ClassVar[tuple[str, ...]] = ("domino_rank", "domino_gru_size")

    domino_rank: int = knob(256, "rank of the [hidden | GRU state] -> vocabulary logit delta (NeMo's emb_dim)")
    domino_gru_size: int = knob(1024, "hidden size of the one-layer GRU over the block's previous tokens")
    domino_pure_prefix: int = knob(1, "first draft slots that keep their base logits (NeMo's pure_draft_prefix_len)")
    domino_lambda_decay_ratio: float = knob(
        0.5, "share of training over which the base loss's weight falls linearly from 1 to 0"
    )

    def validate(self, shared: SharedKnobs) -> None:
        super().validate(shared)
        for name in ("domino_rank", "domino_gru_size"):
            if getattr(self, name) < 1:
                raise knob_error(name, getattr(self, name), "an integer >= 1")
        slots = shared.block_size - shared.first_draft_slot
        if not 0 <= self.domino_pure_prefix < slots:
            raise knob_error("domino_pure_prefix", self.domino_pure_prefix, f"an integer in [0, {slots - 1}]")
        if not 0 < self.domino_lambda_decay_ratio <= 1:
            raise knob_error("domino_lambda_decay_ratio", self.domino_lambda_decay_ratio, "a number in (0, 1]")


@dataclass
class DSparkKnobs(DFlashKnobs):
    """DSpark's serial heads: a low-rank Markov bias from the previous token, and a confidence head."""

    TUNED: ClassVar[tuple[str, ...]] = ("markov_rank", "confidence_loss_weight")

    markov_rank: int = knob(256, "rank r of the previous-token -> vocabulary logit bias (vanilla Markov head)")
    confidence_loss_weight: float = knob(
        1.0, "weight of the confidence head's BCE against each slot's acceptance probability"
    )

    def validate(self, shared: SharedKnobs) -> None:
        super().validate(shared)
        if self.markov_rank < 1:
            raise knob_error("markov_rank", self.markov_rank, "an integer >= 1")
        if self.confidence_loss_weight < 0:
            raise knob_error("confidence_loss_weight", self.confidence_loss_weight, "a number >= 0")


@dataclass
class DFlash2Knobs(SelectorKnobs, ConvKnobs):
    """Conv + selector: the whole of DFlash2."""

    TUNED: ClassVar[tuple[str, ...]] = ConvKnobs.TUNED + SelectorKnobs.TUNED


def flat_section(prefix: str, section: Any) -> dict[str, Any]:
    """`prefix.name` -> value for one knob dataclass, lists and dicts as JSON (as MLflow logs them)."""
    return {
        f"{prefix}.{name}": json.dumps(value) if isinstance(value, (list, dict)) else value
        for name, value in dataclasses.asdict(section).items()
    }


def knob_names(section_type: type) -> set[str]:
    return {item.name for item in dataclasses.fields(section_type)}


def build_section(section_type: type, values: dict[str, Any], prefix: str) -> Any:
    """A knob dataclass from a mapping; an unknown key is an error naming the allowed ones."""
    unknown = sorted(set(values) - knob_names(section_type))
    if unknown:
        allowed = sorted(knob_names(section_type))
        raise knob_error(f"{prefix}.{unknown[0]}", values[unknown[0]], f"knobs {allowed}")
    return section_type(**values)
