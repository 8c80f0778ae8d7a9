"""Name -> draft algorithm, and the one way to build a draft for a target."""

from __future__ import annotations

import torch

from algorithms.dflash import DFlashDraft
from algorithms.dflash2 import DFlash2Draft
from algorithms.knobs import AlgorithmConfig, DFlash2Knobs, knob_error
from algorithms.modeling import DraftConfig, TargetSpec

DRAFT_CLASSES: dict[str, type[DFlashDraft]] = {"dflash": DFlashDraft, "dflash2": DFlash2Draft}


def draft_config(config: AlgorithmConfig, target: TargetSpec) -> DraftConfig:
    """Validate the knobs against the target and resolve the draft decoder config."""
    config.validate()
    shared = config.shared
    if shared.draft_vocab_size is not None and shared.draft_vocab_size != target.vocab_size:
        if config.algorithm == "dflash2":
            raise ValueError(
                f"invalid knob draft_vocab_size={shared.draft_vocab_size!r}: DFlash2 requires the full verifier "
                f"vocabulary (draft={shared.draft_vocab_size}, verifier={target.vocab_size}): serving selects "
                "candidates before any draft->target id mapping."
            )
        raise knob_error(
            "draft_vocab_size",
            shared.draft_vocab_size,
            f"None or the verifier vocab {target.vocab_size} (pruned vocabularies are not supported)",
        )
    top_k = config.knobs.candidate_top_k
    if top_k > target.vocab_size:
        name = "selector_top_k" if config.algorithm == "dflash2" else "metrics_top_k"
        raise knob_error(name, top_k, f"an integer in [1, vocab_size={target.vocab_size}]")
    if shared.mask_token_id is None:
        raise knob_error(
            "mask_token_id", None, f"an existing token id in [0, {target.vocab_size}) (no vocabulary resize)"
        )
    knobs = config.knobs
    is_dflash2 = isinstance(knobs, DFlash2Knobs)
    resolved = DraftConfig(
        target=target,
        num_layers=shared.num_draft_layers,
        block_size=shared.block_size,
        target_layer_ids=shared.resolve_target_layer_ids(target.num_hidden_layers),
        mask_token_id=shared.mask_token_id,
        causal_blocks=shared.block_attention == "causal",
        sliding_window=shared.sliding_window,
        conv_kernel_size=knobs.conv_kernel_size if is_dflash2 else None,
        conv_group_size=knobs.conv_group_size if is_dflash2 else None,
    )
    resolved.validate()
    return resolved


def build_draft(
    config: AlgorithmConfig, target: TargetSpec, embed_weight: torch.Tensor, head_weight: torch.Tensor
) -> DFlashDraft:
    """A freshly initialised draft of `config.algorithm` for the given target and frozen tensors."""
    return DRAFT_CLASSES[config.algorithm](draft_config(config, target), config, embed_weight, head_weight)
