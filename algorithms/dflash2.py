"""DFlash2: DFlash + grouped dynamic convs (in the layers) + a candidate selector, split objective."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from algorithms import losses
from algorithms.conv import GroupedDynamicConv
from algorithms.dflash import BlockForward, DFlashDraft, Proposal
from algorithms.knobs import SelectorKnobs
from algorithms.metrics import MetricCounts, pool, scalar_counts, selector_counts
from algorithms.modeling import DraftConfig
from algorithms.selector import CandidateSelector

if TYPE_CHECKING:
    from algorithms.registry import AlgorithmConfig


def inject_target(
    candidate_ids: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training candidates and labels: a missing target replaces the weakest candidate (label K-1).

    Also returns `present` [M]: whether the original top-K held the target.
    """
    top_k = candidate_ids.shape[-1]
    matches = candidate_ids == target_ids[:, None]
    present = matches.any(-1)
    labels = torch.where(present, matches.long().argmax(-1), torch.full_like(target_ids, top_k - 1))
    injected = candidate_ids.clone()
    injected[:, -1] = torch.where(present, candidate_ids[:, -1], target_ids)
    return injected, labels, present


def replace_weakest(values: torch.Tensor, replacement: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Per-candidate values [M, K] of the injected candidates: the last column follows the injection."""
    last = torch.where(present, values[:, -1], replacement)
    return torch.cat([values[:, :-1], last[:, None]], dim=1)


class DFlash2Draft(DFlashDraft):
    """A draft with the candidate selector and the split objective; DFlash2 when its layers also have convs."""

    def __init__(
        self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor
    ) -> None:
        super().__init__(config, algorithm, embed_weight, head_weight)
        knobs: SelectorKnobs = algorithm.knobs
        self.knobs = knobs
        self.candidate_selector = CandidateSelector(
            config.target.vocab_size, config.hidden_size, knobs.selector_rank, knobs.selector_init
        )

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.candidate_selector.reset_parameters()

    # The peers' DFlash2 format (and llama.cpp's) always has convs: a draft whose layers have none (DFlash + selector)
    # is written with the identity conv, one tap over one group (spec §4.1's init), which computes exactly the
    # conv-free layer.
    IDENTITY_CONV = {"conv_kernel_size": 1, "conv_group_size": None}  # None: the hidden size (one group)

    def export_fields(self) -> dict[str, int | None]:
        conv = super().export_fields() or {**self.IDENTITY_CONV, "conv_group_size": self.config.hidden_size}
        return {**conv, "selector_rank": self.knobs.selector_rank, "selector_top_k": self.candidate_top_k}

    def export_tensors(self) -> dict[str, torch.Tensor]:
        tensors = super().export_tensors()
        if self.config.conv_kernel_size is None:
            identity = GroupedDynamicConv(self.config.hidden_size, 1, self.config.hidden_size).state_dict()
            for index in range(len(self.layers)):
                for conv in ("attention_conv", "mlp_conv"):
                    tensors |= {f"layers.{index}.{conv}.{name}": value for name, value in identity.items()}
        return tensors

    def teacher_predecessors(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """p_k = x_{a+k-1}, the dataset token; slot 0 reuses the anchor. [2,3,4,5] -> [2,2,3,4]."""
        return torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1).reshape(-1)

    def objective(self, out: BlockForward) -> tuple[torch.Tensor, MetricCounts]:
        """L = L_unary + alpha_sel * L_sel, with L_sel a K-way CE over the (injected) unary top-K."""
        stats, selector = out.head.stats, self.candidate_selector
        first, size, top_k = self.shared.first_draft_slot, self.block_size, self.candidate_top_k
        predecessors = self.teacher_predecessors(out.block_tokens)
        _, labels, present = inject_target(stats.candidate_ids, stats.target_ids)
        # Score the K candidates and the target token in one pass: the training scores (target injected
        # where missing) and the teacher-forced scores (original candidates) share everything else.
        projected = selector.hidden_projection(out.hidden)
        successors = selector.successors(torch.cat([stats.candidate_ids, stats.target_ids[:, None]], dim=1))
        unary = torch.cat([stats.candidate_logits, stats.target_token_logits[:, None]], dim=1)
        all_scores = unary.float() + selector.transition(projected, predecessors, successors)
        training_scores = replace_weakest(all_scores[:, :top_k], all_scores[:, top_k], present)
        selector_loss = self.weighted_loss(losses.selector_cross_entropy(training_scores, labels), out.mask)
        unary_loss = out.head.loss
        loss = (
            unary_loss + self.knobs.selector_loss_alpha * selector_loss
            if self.knobs.selector_loss_alpha > 0
            else unary_loss
        )

        with torch.no_grad():
            walk = selector.walk_projected(
                self.draft_slots(stats.candidate_logits),
                self.draft_slots(stats.candidate_ids),
                self.draft_slots(projected),
                self.draft_slots(successors[:, :top_k]),
                out.block_tokens[:, 0],
            )
            injected_logprobs = replace_weakest(stats.target_candidate_logprobs, stats.target_max_logprobs, present)
            counts = selector_counts(
                all_scores[:, :top_k].detach(), stats, out.mask, walk.tokens, injected_logprobs, size, first
            )
        pool(counts, scalar_counts({"selector_loss": selector_loss}, out.mask.sum()))
        return loss, counts

    def propose_from_hidden(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator
    ) -> Proposal:
        """The selector walk over the unary top-K: greedy at T=0, sampled with realized rows at T>0."""
        candidate_unary, candidate_ids = logits.topk(self.candidate_top_k, dim=-1)
        walk = self.candidate_selector.walk(
            candidate_unary[None],
            candidate_ids[None],
            hidden[None],
            torch.tensor([anchor_id], device=hidden.device),
            temperature,
            generator,
        )
        return Proposal(walk.tokens[0], None if walk.probs is None else walk.probs[0], candidate_ids)
