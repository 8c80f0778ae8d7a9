"""Build NeMo AutoModel 0.7.0's family members with our weights, for side-by-side checks.

NeMo is installed with `--no-deps` (it pins another transformers); its speculative modules import on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn

from algorithms.blocks import Anchors, PackedRow
from algorithms.dflash import DFlashDraft
from benchmarks.common.peers import qwen3_shape

NEMO_DFLASH = "nemo_automodel.components.speculative.dflash"


def nemo_backbone(ours: DFlashDraft, **dflash_config):
    """NeMo's Qwen3 DFlash draft with our shapes and trainable weights (the same parameter names); extra
    `dflash_config` fields switch on a head (Domino's `projector_type`, ...)."""
    from nemo_automodel.components.speculative.dflash.draft_qwen3 import (
        Qwen3DFlashDraftModel,
        build_qwen3_dflash_draft_config,
    )
    from transformers import Qwen3Config

    cfg, target = ours.config, ours.config.target
    target_config = Qwen3Config(**qwen3_shape(target, target.num_hidden_layers), tie_word_embeddings=False)
    config = build_qwen3_dflash_draft_config(
        target_config,
        num_draft_layers=cfg.num_layers,
        num_target_layers=target.num_hidden_layers,
        block_size=cfg.block_size,
        # NeMo counts aux layers from the first decoder layer (HF hidden_states index - 1), as Z Lab does
        dflash_config={
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
            **dflash_config,
        },
        attention_backend="sdpa",
    )
    theirs = Qwen3DFlashDraftModel(config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.float()


def nemo_dspark(ours: DFlashDraft, num_anchors: int):
    """NeMo's Qwen3 DSpark draft (a model of its own, not built on its DFlash draft) with our shapes, knobs and
    weights: the same parameter names, plus the verifier's embedding and head as its own input and output
    layers."""
    from nemo_automodel.components.speculative.dspark.config import build_draft_config
    from nemo_automodel.components.speculative.dspark.draft_qwen3 import Qwen3DSparkModel
    from transformers import Qwen3Config

    class Args(dict):
        __getattr__ = dict.__getitem__

    cfg, target = ours.config, ours.config.target
    target_config = Qwen3Config(**qwen3_shape(target, target.num_hidden_layers), tie_word_embeddings=False)
    args = Args(
        num_draft_layers=cfg.num_layers,
        target_layer_ids=[i - 1 for i in cfg.target_layer_ids],  # NeMo counts from the first decoder layer
        confidence_head_alpha=ours.knobs.confidence_loss_weight,
        confidence_head_with_markov=True,
        markov_rank=ours.knobs.markov_rank,
        markov_head_type="vanilla",
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        num_anchors=num_anchors,
    )
    config = build_draft_config(target_config, args)
    config._attn_implementation = "sdpa"  # its training default is flex attention
    theirs = Qwen3DSparkModel(config)
    weights = {**ours.state_dict(), "embed_tokens.weight": ours.embed_weight, "lm_head.weight": ours.head_weight}
    theirs.load_state_dict(weights, strict=True)
    return theirs.float()


def frozen_modules(ours: DFlashDraft) -> tuple[nn.Module, nn.Module]:
    """The verifier's head and input embedding as modules holding our frozen tensors."""
    head = nn.Linear(ours.head_weight.shape[1], ours.head_weight.shape[0], bias=False)
    embed = nn.Embedding(*ours.embed_weight.shape)
    with torch.no_grad():
        head.weight.copy_(ours.head_weight)
        embed.weight.copy_(ours.embed_weight)
    return head.requires_grad_(False), embed.requires_grad_(False)


@contextmanager
def fixed_nemo_anchors(
    anchors: Anchors, where: str = f"{NEMO_DFLASH}.core.DFlashTrainerModule._sample_anchor_positions"
):
    """NeMo draws anchors inside its trainer (its DSpark draft: `NEMO_DSPARK_ANCHORS`); pin them to ours for a
    like-for-like batch (one row)."""
    with mock.patch(where, return_value=(anchors.positions[None], anchors.valid[None])):
        yield


NEMO_DSPARK_ANCHORS = "nemo_automodel.components.speculative.dspark.draft_qwen3.sample_anchor_positions"


def nemo_dspark_loss(
    theirs: nn.Module, row: PackedRow, anchors: Anchors, confidence_weight: float, **packing: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """NeMo's DSpark forward on one row with our anchors, then its `compute_dspark_loss` at the published mix
    (0.1 CE + 0.9 L1, no decay): (loss, its terms). `packing`: NeMo's position_ids, seq_lens, doc_remaining."""
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

    with fixed_nemo_anchors(anchors, NEMO_DSPARK_ANCHORS):
        outputs = theirs(
            input_ids=row.input_ids[None],
            target_hidden_states=row.features[None],
            loss_mask=row.loss_mask[None],
            target_last_hidden_states=row.target_hidden[None],
            **packing,
        )
    return compute_dspark_loss(
        outputs=outputs,
        loss_decay_gamma=None,
        ce_loss_alpha=0.1,
        l1_loss_alpha=0.9,
        confidence_head_alpha=confidence_weight,
        return_terms=True,
    )


def nemo_row_inputs(row: PackedRow, head: nn.Module | None = None) -> dict:
    """One unpacked row as NeMo's trainers take it: ids, aux features, loss mask (and the target's logits, for
    the distilling members)."""
    inputs = dict(input_ids=row.input_ids[None], hidden_states=row.features[None], loss_mask=row.loss_mask[None])
    if head is not None:
        with torch.no_grad():
            inputs["target_logits"] = head(row.target_hidden)[None]
    return inputs


def greedy_dataset_row(row: PackedRow, head: nn.Module) -> PackedRow:
    """`row` with each token after the first the target's greedy choice at the position before it: the
    greedy-regenerated data our CE assumes (CE against the target's token = CE against the dataset's)."""
    with torch.no_grad():
        greedy = head(row.target_hidden).argmax(-1)
    row.input_ids = torch.cat([row.input_ids[:1], greedy[:-1]])
    return row
