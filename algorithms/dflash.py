"""DFlash: parallel block drafting from target context features, trained on unary logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from algorithms import losses
from algorithms.blocks import (
    Anchors,
    AttentionTile,
    LabelRule,
    PackedRow,
    aligned_loss_mask,
    attention_tiles,
    block_indices,
    draft_slots,
    target_indices,
)
from algorithms.metrics import MetricCounts, path_counts, pool, scalar_counts, unary_counts
from algorithms.modeling import DraftBackbone, DraftConfig
from algorithms.sampling import draw
from algorithms.selector import CandidateSelector
from algorithms.unary_head import UnaryHead, UnaryObjective, unary_head

# Queries per block-sparse attention tile: small enough to skip most of the dense mask, large enough
# that per-tile overhead stays negligible.
ATTENTION_TILE_QUERIES = 128

if TYPE_CHECKING:
    from algorithms.registry import AlgorithmConfig


@dataclass
class StepOutput:
    """One training/validation forward: the differentiable loss and pooled metric counts."""

    loss: torch.Tensor
    counts: MetricCounts


@dataclass
class BlockForward:
    """Everything one anchored-block forward produces, shared by the loss and the metrics."""

    hidden: torch.Tensor  # [M, H] final-normed draft states
    head: UnaryHead  # unary loss and per-row statistics against the verifier's logits
    mask: torch.Tensor  # [M] aligned loss mask
    block_tokens: torch.Tensor  # [N, B] dataset tokens under each block
    target_hidden: torch.Tensor  # [M, H] the target's final states that supervise each row


@dataclass
class Proposal:
    """Draft tokens for one block and the distribution each was drawn from (for verification)."""

    tokens: torch.Tensor  # [S]
    probs: torch.Tensor | None  # [S, V] (DFlash) or [S, K] (DFlash2) at temperature > 0
    candidate_ids: torch.Tensor | None  # [S, K] for DFlash2
    confidence: torch.Tensor | None = None  # [S] predicted acceptance of each slot, for a member with a confidence head

    def scheduled(self, threshold: float) -> Proposal:
        """The prefix a confidence-scheduled verification sends to the target: the slots whose predicted
        cumulative acceptance stays at or above `threshold`; the whole block without a confidence head or at
        threshold 0. It depends on the draft alone, so verifying it stays lossless."""
        if self.confidence is None or threshold <= 0:
            return self
        keep = int((self.confidence.cumprod(0) >= threshold).sum())  # a prefix: the product never grows
        cut = lambda t: None if t is None else t[:keep]  # noqa: E731
        return Proposal(self.tokens[:keep], cut(self.probs), cut(self.candidate_ids), self.confidence[:keep])


class DFlashDraft(DraftBackbone):
    """The DFlash draft: backbone + unary objective + unary proposals."""

    # False for a member whose loss leaves the unary (base) logits out: its unary head then computes the
    # statistics the metrics read, without the gradient nothing would use.
    trains_unary_head = True

    def __init__(
        self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor
    ) -> None:
        super().__init__(config, embed_weight, head_weight)
        self.algorithm = algorithm
        self.shared = algorithm.shared

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def candidate_top_k(self) -> int:
        return self.shared.candidate_top_k

    @property
    def unary_objective(self) -> UnaryObjective:
        shared = self.shared
        return UnaryObjective(
            loss_weights=shared.loss_weights,
            position_weighting=shared.position_weighting,
            decay_gamma=shared.decay_gamma,
            dpace_alpha=shared.dpace_alpha,
            sample_from_anchor=shared.sample_from_anchor,
            block_size=self.block_size,
            top_k=self.candidate_top_k,
        )

    def forward_blocks(self, row: PackedRow, anchors: Anchors) -> BlockForward:
        """Run all anchored blocks of a packed row as one flattened query axis."""
        size = self.block_size
        flat = block_indices(anchors.positions, size)
        block_ids = torch.full_like(flat, self.config.mask_token_id)
        block_ids[::size] = row.input_ids[anchors.positions]
        slots = torch.arange(flat.shape[0], device=flat.device) % size
        block_positions = row.position_ids[anchors.positions].repeat_interleave(size) + slots
        tiles = attention_tiles(
            anchors,
            row.document_ids,
            size,
            self.config.causal_blocks,
            self.config.sliding_window,
            blocks_per_tile=max(1, ATTENTION_TILE_QUERIES // size),
        )
        hidden = self(row.features, row.position_ids, block_ids, block_positions, tiles, size)
        loss_mask = self.supervision(row, anchors)
        target_rows = target_indices(anchors.positions, size, row.length, self.shared.sample_from_anchor)
        head = unary_head(
            hidden if self.trains_unary_head else hidden.detach(),
            row.target_hidden,
            target_rows,
            loss_mask,
            self.head_weight,
            self.logit_transform,
            self.unary_objective,
        )
        block_tokens = row.input_ids[flat].view(-1, size)
        return BlockForward(hidden, head, loss_mask, block_tokens, row.target_hidden[target_rows])

    @property
    def first_slot(self) -> int:
        return self.shared.first_draft_slot

    @property
    def label_rule(self) -> LabelRule:
        return LabelRule(self.shared.label_offset, self.first_slot, self.algorithm.entry.contiguous_supervision)

    def supervision(self, row: PackedRow, anchors: Anchors) -> torch.Tensor:
        """The aligned loss mask [M]: which block slots carry loss, each gated by its own label's mask."""
        return aligned_loss_mask(row.loss_mask, row.document_ids, anchors, self.block_size, self.label_rule)

    def draft_slots(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-row values [M, ...] as [N, S, ...] over this draft's predicted slots."""
        return draft_slots(flat, self.block_size, self.first_slot)

    def set_training_progress(self, step: int, total_steps: int) -> None:
        """Told before each training step; a member whose objective follows a schedule reads it here."""

    def batch_share(self, row: PackedRow, anchors: Anchors, part: Anchors) -> float:
        """The weight of `part`'s loss in the loss over all `anchors` (host tensors): a data-parallel rank scales
        its loss by it, so that the ranks' gradients add up to the gradient of the whole batch."""
        whole = losses.denominator(self.supervision(row, anchors))
        return float(losses.denominator(self.supervision(row, part))) / float(whole)

    def full_vocabulary_loss(
        self, logits: torch.Tensor, out: BlockForward
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The run's loss terms and position weighting on full-vocabulary logits [M, V] of every row (a member's
        corrected logits): (loss, their log-probs, the target's log-probs)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        with torch.no_grad():
            target_logprobs = torch.log_softmax(self.output_logits(out.target_hidden), dim=-1)
        loss = sum(
            weight * self.weighted_loss(losses.PER_POSITION_LOSSES[name](logprobs, target_logprobs), out.mask)
            for name, weight in self.shared.loss_weights.items()
        )
        return loss, logprobs, target_logprobs

    def realized_counts(self, walked: torch.Tensor, out: BlockForward) -> MetricCounts:
        """Accepted-length counts of a walked path [N, S] against the target's tokens."""
        correct = walked == self.draft_slots(out.head.stats.target_ids)
        return path_counts("realized", correct, self.draft_slots(out.mask > 0), self.first_slot)

    def weighted_loss(self, per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Reduce one per-position term with the configured position weighting."""
        return losses.reduce_weighted(per_position, self.unary_objective.weights(per_position, mask), mask)

    def training_forward(self, row: PackedRow, anchors: Anchors) -> StepOutput:
        out = self.forward_blocks(row, anchors)
        loss, counts = self.objective(out)
        scalars = {"loss": loss, "unary_loss": out.head.loss}
        if len(out.head.terms) > 1:
            scalars.update({f"{name}_loss": value for name, value in out.head.terms.items()})
        pool(counts, scalar_counts(scalars, out.mask.sum()))
        pool(counts, unary_counts(out.head.stats, out.mask, self.block_size, self.shared.first_draft_slot))
        return StepOutput(loss, counts)

    # Layers with convs exist in the peers' format (and llama.cpp's) only as DFlash2, which always has a selector: a
    # draft with convs and no selector (DFlash + conv) is written with the null selector, one candidate and rank 1
    # with zero codebooks, whose walk is the unary argmax path that this draft decodes.
    NULL_SELECTOR = {"selector_rank": 1, "selector_top_k": 1}

    def export_fields(self) -> dict[str, int | None]:
        """Algorithm fields of the exported config, under the peers' names (conv fields when the layers have one)."""
        if self.config.conv_kernel_size is None:
            return {}
        conv = {"conv_kernel_size": self.config.conv_kernel_size, "conv_group_size": self.config.conv_group_size}
        return conv if self.algorithm.entry.has_selector else {**conv, **self.NULL_SELECTOR}

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of an exported checkpoint, under the draft's own names (a null selector added where the
        format needs one)."""
        tensors = dict(self.state_dict())
        if self.config.conv_kernel_size is not None and not self.algorithm.entry.has_selector:
            null = CandidateSelector(self.config.target.vocab_size, self.config.hidden_size, 1)
            tensors |= {
                f"candidate_selector.{name}": torch.zeros_like(value) for name, value in null.state_dict().items()
            }
        return tensors

    def objective(self, out: BlockForward) -> tuple[torch.Tensor, MetricCounts]:
        """DFlash's loss is the unary loss; its realized path is the unary argmax path."""
        correct = self.draft_slots(out.head.stats.draft_ids == out.head.stats.target_ids)
        return out.head.loss, path_counts("realized", correct, self.draft_slots(out.mask > 0), self.first_slot)

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
        vocabulary: torch.Tensor | None = None,
    ) -> Proposal:
        """Draft one block [anchor, MASK x (B-1)] and propose its draft slots; shorter near a limit. With
        `vocabulary` (token ids, at least `candidate_top_k` of them) it proposes only those, as a draft served with a
        reduced head does."""
        first = self.shared.first_draft_slot
        slots = self.block_size - first if num_slots is None else num_slots
        size = min(self.block_size, slots + first)
        hidden = self.single_block_hidden(features, context_positions, anchor_id, anchor_position, size)
        # Logits for the whole block, then drop slot 0: a full block is also the fast GEMM shape on CPU (MKL).
        logits = self.output_logits(hidden)[first:]
        if vocabulary is not None:
            kept = logits.index_select(-1, vocabulary)
            logits = torch.full_like(logits, float("-inf")).index_copy(-1, vocabulary, kept)
        return self.propose_from_hidden(hidden[first:], logits, anchor_id, temperature, generator)

    def single_block_hidden(
        self, features, context_positions, anchor_id: int, anchor_position: int, size: int
    ) -> torch.Tensor:
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
        tile = AttentionTile(slice(0, size), slice(0, length), torch.cat([context_visible, block_visible], dim=1))
        return self(features, context_positions, block_ids, block_positions, [tile], size)

    def propose_from_hidden(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator
    ) -> Proposal:
        """Proposals from the draft slots' hidden states and transformed unary logits."""
        return Proposal(*draw(logits, temperature, generator), None)
