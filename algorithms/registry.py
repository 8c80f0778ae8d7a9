"""The algorithm table: each entry names a draft class, its knobs, its published shared defaults and
its export format. Everything above `algorithms/` asks this table instead of branching on a name.

Entries: DFlash; the component ablation of the DFlash2 write-up (DFlash + conv, DFlash + selector with the
split objective, and DFlash2 = both); and the family's other members (JetSpec, Domino, DSpark).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from algorithms.dflash import DFlashDraft
from algorithms.dflash2 import DFlash2Draft
from algorithms.domino import DominoDraft
from algorithms.dspark import DSparkDraft
from algorithms.knobs import (
    ConvKnobs,
    DFlash2Knobs,
    DFlashKnobs,
    DominoKnobs,
    DSparkKnobs,
    SelectorKnobs,
    SharedKnobs,
    build_section,
    flat_section,
    knob_error,
    knob_names,
)
from algorithms.modeling import DraftConfig, TargetLayers, TargetSpec

# Published shared defaults: DFlash trains blocks of 16 with CE + D-PACE, DFlash2 blocks of 8 with KL
# and a fixed exponential decay. The component variants are DFlash2 with a part removed, so they
# start from DFlash2's.
DFLASH_SHARED = {"block_size": 16, "loss": "ce", "position_weighting": "dpace"}
DFLASH2_SHARED = {"block_size": 8, "loss": "kl_div", "position_weighting": "fixed-exp-decay"}
# JetSpec keeps DFlash's draft and block size, attends causally inside a block and distils with forward KL at
# temperature 1 over every predicted slot alike (NeMo AutoModel's JetSpec recipe).
JETSPEC_DEFINING = {"loss": "kl_div", "position_weighting": "uniform", "block_attention": "causal"}
JETSPEC_SHARED = {"block_size": 16, **JETSPEC_DEFINING}
# Domino (NeMo AutoModel's Domino recipe): block 16, CE with gamma = 7 decay, the block read from the anchor on.
DOMINO_SHARED = {
    "block_size": 16,
    "loss": "ce",
    "position_weighting": "fixed-exp-decay",
    "decay_gamma": 7.0,
    "sample_from_anchor": True,
}

# DSpark (NeMo AutoModel's DSpark and DeepSpec's recipe): blocks of 7 predicted from the anchor on, 0.1 CE +
# 0.9 L1 probability distance (= 2 TV, so 1.8 on our `tv`), exponential decay with gamma = 4. The token loss
# mix is what the member is: a like-for-like preset keeps it.
DSPARK_DEFINING = {"loss": {"ce": 0.1, "tv": 1.8}}
DSPARK_SHARED = {
    "block_size": 7,
    "position_weighting": "fixed-exp-decay",
    "decay_gamma": 4.0,
    "sample_from_anchor": True,
    **DSPARK_DEFINING,
}


@dataclass(frozen=True)
class PeerFormat:
    """How Z Lab dflash, speculators and vLLM name this algorithm in a checkpoint config."""

    model_type: str  # speculators_model_type
    architecture: str  # config.json `architectures`
    serve_as: str = "draft-dflash"  # llama.cpp's --spec-type for it


@dataclass(frozen=True)
class Algorithm:
    """One registered draft algorithm."""

    name: str
    draft_class: type[DFlashDraft]
    knobs_class: type[DFlashKnobs]
    published_shared: dict[str, Any]
    description: str
    # The peer format an export is written in; None: no peer can load this variant.
    export_format: PeerFormat | None
    # Shared knobs that make this member what it is: a preset that pins shared knobs alike for every member
    # (`small`) keeps these, so a like-for-like comparison still compares the members.
    defining_shared: dict[str, Any] = field(default_factory=dict)
    # True where the published member trains only each block's leading run of supervised slots (DSpark): the
    # first unsupervised label ends the block's loss, as the end of a turn ends decoding.
    contiguous_supervision: bool = False

    @property
    def has_conv(self) -> bool:
        return issubclass(self.knobs_class, ConvKnobs)

    @property
    def has_selector(self) -> bool:
        return issubclass(self.knobs_class, SelectorKnobs)

    @property
    def tuned_knobs(self) -> tuple[str, ...]:
        """Knobs a study may sweep for this algorithm."""
        return self.knobs_class.TUNED


ALGORITHMS: dict[str, Algorithm] = {
    entry.name: entry
    for entry in (
        Algorithm(
            "dflash",
            DFlashDraft,
            DFlashKnobs,
            DFLASH_SHARED,
            "DFlash: unary parallel drafting",
            PeerFormat("dflash", "DFlashDraftModel"),
        ),
        Algorithm(
            "dflash+conv",
            DFlashDraft,
            ConvKnobs,
            DFLASH2_SHARED,
            "DFlash + grouped dynamic conv, unary decoding",
            PeerFormat("dflash2", "DFlash2DraftModel"),  # written with the null selector (DFlashDraft.export_tensors)
        ),
        Algorithm(
            "dflash+selector",
            DFlash2Draft,
            SelectorKnobs,
            DFLASH2_SHARED,
            "DFlash + candidate selector and split objective, no conv",
            PeerFormat("dflash2", "DFlash2DraftModel"),  # written with the identity conv (DFlash2Draft.export_tensors)
        ),
        Algorithm(
            "dflash2",
            DFlash2Draft,
            DFlash2Knobs,
            DFLASH2_SHARED,
            "DFlash2: conv + selector",
            PeerFormat("dflash2", "DFlash2DraftModel"),
        ),
        Algorithm(
            "jetspec",
            DFlashDraft,
            DFlashKnobs,
            JETSPEC_SHARED,
            "JetSpec: DFlash with causal in-block attention, forward KL and no position decay",
            PeerFormat("dflash", "DFlashDraftModel"),
            JETSPEC_DEFINING,
        ),
        Algorithm(
            "domino",
            DominoDraft,
            DominoKnobs,
            DOMINO_SHARED,
            "Domino: DFlash + a GRU correction head over the block's previous tokens (logit delta)",
            None,
        ),
        Algorithm(
            "dspark",
            DSparkDraft,
            DSparkKnobs,
            DSPARK_SHARED,
            "DSpark: DFlash + a low-rank Markov bias from the previous token and a per-slot confidence head",
            PeerFormat("dspark", "DSparkDraftModel", "draft-dspark"),
            DSPARK_DEFINING,
            contiguous_supervision=True,
        ),
    )
}


# The algorithm every other one extends: the baseline that component gains are measured against.
REFERENCE_ALGORITHM = "dflash"

# Design factors that switch a component on or off: a designed study's point picks the variant that has
# exactly the components it switches on (the 2x2 component ablation: conv x selector).
COMPONENT_FACTORS = ("conv", "selector")
COMPONENT_VARIANTS = {(False, False): "dflash", (True, False): "dflash+conv", (False, True): "dflash+selector"}
COMPONENT_VARIANTS[(True, True)] = "dflash2"


def component_variant(conv: bool, selector: bool) -> str:
    """The registered variant with exactly these components."""
    return COMPONENT_VARIANTS[(bool(conv), bool(selector))]


# A one-at-a-time design factor whose levels are registered members: the family comparison (DFlash at the
# centre, each other member one move away), every shared knob the members have in common kept.
MEMBER_FACTOR = "algorithm"


def with_design_point(
    config: AlgorithmConfig, point: dict[str, Any], member_knobs: dict[str, Any] | None = None
) -> AlgorithmConfig:
    """`config` moved to a design point: component factors choose the variant (keeping the knobs it has), a
    member factor chooses the member (taking `member_knobs` where it has them), every other factor is a knob
    value."""
    components = {f: point[f] for f in COMPONENT_FACTORS if f in point}
    if components:
        entry = config.entry
        chosen = {"conv": entry.has_conv, "selector": entry.has_selector, **components}
        config = config.with_algorithm(component_variant(chosen["conv"], chosen["selector"]))
    if MEMBER_FACTOR in point:
        config = config.with_algorithm(point[MEMBER_FACTOR])
        own = knob_names(type(config.knobs))
        config = config.replace(**{k: v for k, v in (member_knobs or {}).items() if k in own})
    moved = (*COMPONENT_FACTORS, MEMBER_FACTOR)
    return config.replace(**{k: v for k, v in point.items() if k not in moved})


def algorithm_entry(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise knob_error("algorithm", name, f"one of {list(ALGORITHMS)}")
    return ALGORITHMS[name]


@dataclass
class AlgorithmConfig:
    """An algorithm name with its shared and algorithm-specific knobs."""

    algorithm: str
    shared: SharedKnobs = field(default_factory=SharedKnobs)
    knobs: DFlashKnobs = field(default_factory=DFlashKnobs)

    @property
    def entry(self) -> Algorithm:
        return algorithm_entry(self.algorithm)

    @classmethod
    def preset(cls, algorithm: str, **overrides: Any) -> AlgorithmConfig:
        """The algorithm's published defaults, with flat overrides (shared or algorithm knobs)."""
        entry = algorithm_entry(algorithm)
        config = cls(algorithm, SharedKnobs(**entry.published_shared), entry.knobs_class())
        return config.replace(**overrides)

    def knob_names(self) -> set[str]:
        """Every flat knob name this algorithm accepts."""
        return knob_names(SharedKnobs) | knob_names(type(self.knobs))

    def replace(self, **overrides: Any) -> AlgorithmConfig:
        """A copy with flat knob overrides; an unknown name is an error, not a silent no-op."""
        shared_names, algo_names = knob_names(SharedKnobs), knob_names(type(self.knobs))
        unknown = set(overrides) - shared_names - algo_names
        if unknown:
            raise knob_error(
                "knob", sorted(unknown)[0], f"a knob of {self.algorithm}: {sorted(shared_names | algo_names)}"
            )
        shared = dataclasses.replace(self.shared, **{k: v for k, v in overrides.items() if k in shared_names})
        knobs = dataclasses.replace(self.knobs, **{k: v for k, v in overrides.items() if k in algo_names})
        return AlgorithmConfig(self.algorithm, shared, knobs)

    def with_algorithm(self, algorithm: str) -> AlgorithmConfig:
        """Another algorithm with the same shared knobs, and these knobs wherever it has them. Only defining
        knobs change: this member's go back to the other's published values, then the other's apply."""
        entry = algorithm_entry(algorithm)
        published = SharedKnobs(**entry.published_shared)
        reverted = {name: getattr(published, name) for name in self.entry.defining_shared}
        shared = dataclasses.replace(self.shared, **{**reverted, **entry.defining_shared})
        own = dataclasses.asdict(self.knobs)
        return AlgorithmConfig(
            algorithm,
            shared,
            entry.knobs_class(**{k: v for k, v in own.items() if k in knob_names(entry.knobs_class)}),
        )

    def validate(self) -> None:
        knobs_class = self.entry.knobs_class
        if type(self.knobs) is not knobs_class:
            raise knob_error("knobs", type(self.knobs).__name__, knobs_class.__name__)
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
        entry = algorithm_entry(data["algorithm"])
        shared = build_section(SharedKnobs, data.get("shared", {}), "shared")
        return cls(entry.name, shared, build_section(entry.knobs_class, data.get("knobs", {}), "knobs"))

    def flat_params(self) -> dict[str, Any]:
        """Flattened `shared.*` / `algo.*` names, as logged to MLflow."""
        return {"algorithm": self.algorithm, **flat_section("shared", self.shared), **flat_section("algo", self.knobs)}


def draft_config(config: AlgorithmConfig, target: TargetSpec) -> DraftConfig:
    """Validate the knobs against the target and resolve the draft decoder config."""
    config.validate()
    shared, entry = config.shared, config.entry
    if shared.draft_vocab_size is not None and shared.draft_vocab_size != target.vocab_size:
        allowed = f"None or the verifier vocab {target.vocab_size} (pruned vocabularies are not supported)"
        if entry.has_selector:
            allowed = (
                f"the full verifier vocabulary {target.vocab_size}: a selector picks candidates "
                "before any draft->target id mapping"
            )
        raise knob_error("draft_vocab_size", shared.draft_vocab_size, allowed)
    if shared.candidate_top_k > target.vocab_size:
        raise knob_error(
            "candidate_top_k", shared.candidate_top_k, f"an integer in [1, vocab_size={target.vocab_size}]"
        )
    if shared.mask_token_id is None:
        raise knob_error("mask_token_id", None, f"an existing token id in [0, {target.vocab_size}) (no vocab resize)")
    if shared.draft_init == "target" and shared.num_draft_layers > target.num_hidden_layers:
        allowed = f"random for a draft deeper than its target's {target.num_hidden_layers} layers"
        raise knob_error("draft_init", "target", allowed)
    conv: ConvKnobs | None = config.knobs if entry.has_conv else None
    resolved = DraftConfig(
        target=target,
        num_layers=shared.num_draft_layers,
        block_size=shared.block_size,
        target_layer_ids=shared.resolve_target_layer_ids(target.num_hidden_layers),
        mask_token_id=shared.mask_token_id,
        causal_blocks=shared.block_attention == "causal",
        sliding_window=shared.sliding_window,
        conv_kernel_size=conv.conv_kernel_size if conv else None,
        conv_group_size=conv.conv_group_size if conv else None,
    )
    resolved.validate()
    return resolved


def build_draft(
    config: AlgorithmConfig,
    target: TargetSpec,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    target_layers: TargetLayers | None = None,
) -> DFlashDraft:
    """A freshly initialised draft of `config.algorithm` for the given target and frozen tensors; `draft_init:
    target` starts its layers from `target_layers`, which it then needs."""
    draft = config.entry.draft_class(draft_config(config, target), config, embed_weight, head_weight)
    if config.shared.draft_init == "target":
        if target_layers is None:
            raise knob_error("draft_init", "target", "random where the target's layers are not loaded")
        draft.init_from_target(target_layers)
    return draft
