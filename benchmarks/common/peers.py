"""Build speculators 0.9.0's DFlash/DFlash2 drafts with our weights, for side-by-side checks."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch

from algorithms.blocks import Anchors, PackedRow
from algorithms.dflash import DFlashDraft
from algorithms.modeling import TargetSpec


def peer_model_type(ours) -> str:
    """The speculators model type our draft maps to (only algorithms with a peer format have one)."""
    return ours.algorithm.entry.export_format.model_type


def qwen3_shape(target: TargetSpec, num_layers: int) -> dict:
    """A Qwen3 config's shape fields: `num_layers` decoder layers of the target's width."""
    return dict(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
    )


def speculators_draft(ours: DFlashDraft, attention: str = "sdpa"):
    """A speculators model with identical shapes, knobs and weights (frozen tensors included)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    cfg, target = ours.config, ours.config.target
    layer_config = Qwen3Config(
        **qwen3_shape(target, cfg.num_layers),
        layer_types=["sliding_attention"] * cfg.num_layers,
        sliding_window=cfg.sliding_window,
        use_sliding_window=True,
        max_window_layers=cfg.num_layers,
    )
    layer_config._attn_implementation = attention
    common = dict(
        transformer_layer_config=layer_config,
        draft_vocab_size=target.vocab_size,
        block_size=cfg.block_size,
        aux_hidden_state_layer_ids=cfg.target_layer_ids,
        mask_token_id=cfg.mask_token_id,
        sliding_window_non_causal=not cfg.causal_blocks,
        sample_from_anchor=ours.shared.sample_from_anchor,
        speculators_config=SpeculatorsConfig(
            algorithm=ours.algorithm.algorithm,
            default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.block_size - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    if peer_model_type(ours) == "dflash2":
        knobs = ours.algorithm.knobs
        theirs = DFlash2DraftModel(
            DFlash2SpeculatorConfig(
                **common,
                conv_kernel_size=knobs.conv_kernel_size,
                conv_group_size=knobs.conv_group_size,
                selector_rank=knobs.selector_rank,
                selector_top_k=ours.shared.candidate_top_k,
            )
        )
    else:
        theirs = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    state = dict(ours.state_dict())
    state.update(
        {
            "embed_tokens.weight": ours.embed_weight,
            "lm_head.weight": ours.head_weight,
            "verifier_lm_head.weight": ours.head_weight,
            "verifier_norm.weight": torch.ones(target.hidden_size),
        }
    )
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"t2d", "d2t"}, (missing, unexpected)
    return theirs


@contextmanager
def fixed_anchors(anchors: Anchors):
    """speculators draws anchors internally; pin them to ours for a like-for-like batch."""
    with mock.patch("speculators.models.dflash.core.select_anchors", return_value=(anchors.positions, anchors.valid)):
        yield


def speculators_inputs(row: PackedRow, pre_norm_last_hidden: torch.Tensor) -> dict:
    return dict(
        hidden_states=row.features[None],
        input_ids=row.input_ids[None],
        loss_mask=row.loss_mask[None],
        verifier_last_hidden_states=pre_norm_last_hidden[None],
        document_ids=row.document_ids[None],
        position_ids=row.position_ids[None],
    )


def speculators_train_kwargs(ours: DFlashDraft, losses: str = "eager") -> dict:
    """Their trainer kwargs for our knobs; `losses` is their implementation: eager (CPU) or fused (CUDA)."""
    import json

    from speculators.losses import resolve_loss_config

    shared = ours.shared
    loss = shared.loss if isinstance(shared.loss, str) else json.dumps(shared.loss)
    kwargs = dict(
        loss_config=resolve_loss_config(loss, losses),
        gamma=shared.decay_gamma,
        max_anchors=shared.max_anchors,
        per_position_loss_weight=shared.position_weighting,
        dpace_alpha=shared.dpace_alpha,
    )
    if peer_model_type(ours) == "dflash2":
        kwargs.update(
            tv_loss_fn=resolve_loss_config("tv", losses)["tv"][0], selector_loss_alpha=ours.knobs.selector_loss_alpha
        )
    return kwargs
