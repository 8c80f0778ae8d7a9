"""DFlash: parallel block drafting from target context features, trained on unary logits (spec §2-3, §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms import losses
from algorithms.blocks import (
    Anchors,
    PackedRow,
    aligned_loss_mask,
    block_attention_mask,
    block_indices,
    target_indices,
)
from algorithms.knobs import AlgorithmConfig
from algorithms.metrics import MetricCounts, path_counts, pool, scalar_counts, unary_counts
from algorithms.modeling import DraftBackbone, DraftConfig


@dataclass
class StepOutput:
    """One training/validation forward: the differentiable loss and pooled metric counts."""

    loss: torch.Tensor
    counts: MetricCounts


@dataclass
class BlockForward:
    """Everything one anchored-block forward produces, shared by the loss and the metrics."""

    hidden: torch.Tensor  # [M, H] final-normed draft states
    unary_logits: torch.Tensor  # [M, V] transformed, fp32
    target_logits: torch.Tensor  # [M, V] verifier logits for each slot's target, fp32, no grad
    mask: torch.Tensor  # [M] aligned loss mask
    block_tokens: torch.Tensor  # [N, B] dataset tokens under each block


@dataclass
class Proposal:
    """Draft tokens for one block and the distribution each was drawn from (for verification)."""

    tokens: torch.Tensor  # [S]
    probs: torch.Tensor | None  # [S, V] (DFlash) or [S, K] (DFlash2) at temperature > 0
    candidate_ids: torch.Tensor | None  # [S, K] for DFlash2


class DFlashDraft(DraftBackbone):
    """The DFlash draft: backbone + unary objective + unary proposals."""

    def __init__(self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__(config, embed_weight, head_weight)
        self.algorithm = algorithm
        self.shared = algorithm.shared

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def candidate_top_k(self) -> int:
        return self.algorithm.knobs.candidate_top_k

    def forward_blocks(self, row: PackedRow, anchors: Anchors) -> BlockForward:
        """Run all anchored blocks of a packed row as one flattened query axis."""
        size = self.block_size
        flat = block_indices(anchors.positions, size)
        block_ids = torch.full_like(flat, self.config.mask_token_id)
        block_ids[::size] = row.input_ids[anchors.positions]
        slots = torch.arange(flat.shape[0], device=flat.device) % size
        block_positions = row.position_ids[anchors.positions].repeat_interleave(size) + slots
        mask = block_attention_mask(anchors, row.document_ids, size, self.config.causal_blocks, self.config.sliding_window)
        hidden = self(row.features, row.position_ids, block_ids, block_positions, mask, size)
        with torch.no_grad():
            rows = target_indices(anchors.positions, size, row.length, self.shared.sample_from_anchor)
            target_logits = self.output_logits(row.target_hidden[rows])
        return BlockForward(
            hidden=hidden,
            unary_logits=self.output_logits(hidden),
            target_logits=target_logits,
            mask=aligned_loss_mask(row.loss_mask, anchors, size, self.shared.sample_from_anchor),
            block_tokens=row.input_ids[flat].view(-1, size),
        )

    def weighted_loss(self, per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Reduce one term with the configured position weighting (spec §5.2-5.5)."""
        slots = torch.arange(mask.shape[0], device=mask.device) % self.block_size
        weights = losses.position_weights(
            per_position, mask, slots, self.block_size, self.shared.position_weighting,
            self.shared.decay_gamma, self.shared.dpace_alpha, self.shared.sample_from_anchor,
        )
        return losses.reduce_weighted(per_position, weights, mask)

    def unary_objective(self, draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The compound unary loss and each unweighted term."""
        terms = {
            name: self.weighted_loss(losses.PER_POSITION_LOSSES[name](draft_logprobs, target_logprobs), mask)
            for name in self.shared.loss_weights
        }
        total = sum(weight * terms[name] for name, weight in self.shared.loss_weights.items())
        return total, terms

    def training_forward(self, row: PackedRow, anchors: Anchors) -> StepOutput:
        out = self.forward_blocks(row, anchors)
        draft_logprobs = torch.log_softmax(out.unary_logits, dim=-1)
        target_logprobs = torch.log_softmax(out.target_logits, dim=-1)
        unary_loss, terms = self.unary_objective(draft_logprobs, target_logprobs, out.mask)
        candidate_ids = out.unary_logits.detach().topk(self.candidate_top_k, dim=-1).indices
        loss, counts = self.extra_objective(out, unary_loss, candidate_ids, target_logprobs)
        scalars = {"loss": loss, "unary_loss": unary_loss}
        if len(terms) > 1:
            scalars.update({f"{name}_loss": value for name, value in terms.items()})
        pool(counts, scalar_counts(scalars))
        pool(counts, unary_counts(draft_logprobs.detach(), target_logprobs, out.mask, candidate_ids, self.block_size, self.shared.first_draft_slot))
        return StepOutput(loss, counts)

    def extra_objective(self, out: BlockForward, unary_loss: torch.Tensor, candidate_ids: torch.Tensor, target_logprobs: torch.Tensor) -> tuple[torch.Tensor, MetricCounts]:
        """DFlash's loss is the unary loss; its realized path is the unary argmax path."""
        first = self.shared.first_draft_slot
        blocks = lambda x: x.view(-1, self.block_size)[:, first:]  # noqa: E731
        correct = blocks(out.unary_logits.detach().argmax(-1) == target_logprobs.argmax(-1))
        return unary_loss, path_counts("realized", correct, blocks(out.mask > 0), first)

    @torch.no_grad()
    def propose(
        self,
        features: torch.Tensor,  # [T, n_T*H] context features of positions < anchor
        context_positions: torch.Tensor,  # [T]
        anchor_id: int,
        anchor_position: int,
        num_slots: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Draft one block [anchor, MASK x (B-1)] and propose its draft slots (spec §9); shorter near a limit."""
        first = self.shared.first_draft_slot
        slots = self.block_size - first if num_slots is None else num_slots
        size = min(self.block_size, slots + first)
        hidden = self.single_block_hidden(features, context_positions, anchor_id, anchor_position, size)
        # Logits for the whole block, then drop slot 0: a full block is also the fast GEMM shape on CPU (MKL).
        return self.propose_from_hidden(hidden[first:], self.output_logits(hidden)[first:], anchor_id, temperature, generator)

    def single_block_hidden(self, features, context_positions, anchor_id: int, anchor_position: int, size: int) -> torch.Tensor:
        device = features.device
        block_ids = torch.full((size,), self.config.mask_token_id, dtype=torch.long, device=device)
        block_ids[0] = anchor_id
        block_positions = anchor_position + torch.arange(size, device=device)
        length = features.shape[0]
        context_visible = torch.ones(size, length, dtype=torch.bool, device=device)
        context_visible &= (block_positions[:, None] - context_positions[None, :]).abs() < self.config.sliding_window
        block_visible = torch.ones(size, size, dtype=torch.bool, device=device)
        if self.config.causal_blocks:
            block_visible = block_visible.tril()
        mask = torch.cat([context_visible, block_visible], dim=1)
        return self(features, context_positions, block_ids, block_positions, mask, size)

    def propose_from_hidden(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator) -> Proposal:
        """Proposals from the draft slots' hidden states and transformed unary logits."""
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            return Proposal(torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs, None)
        return Proposal(logits.argmax(-1), None, None)
