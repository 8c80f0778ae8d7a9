"""DFlash2: DFlash + grouped dynamic convs (in the layers) + a candidate selector, split objective (spec §4, §5.6)."""

from __future__ import annotations

import torch

from algorithms import losses
from algorithms.dflash import BlockForward, DFlashDraft, Proposal
from algorithms.knobs import AlgorithmConfig, DFlash2Knobs
from algorithms.metrics import MetricCounts, pool, scalar_counts, selector_counts
from algorithms.modeling import DraftConfig
from algorithms.selector import CandidateSelector


def inject_target(candidate_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training candidates and labels: a missing target replaces the weakest candidate (label K-1)."""
    top_k = candidate_ids.shape[-1]
    matches = candidate_ids == target_ids[:, None]
    present = matches.any(-1)
    labels = torch.where(present, matches.long().argmax(-1), torch.full_like(target_ids, top_k - 1))
    injected = candidate_ids.clone()
    injected[:, -1] = torch.where(present, candidate_ids[:, -1], target_ids)
    return injected, labels


class DFlash2Draft(DFlashDraft):
    def __init__(self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__(config, algorithm, embed_weight, head_weight)
        knobs: DFlash2Knobs = algorithm.knobs
        self.knobs = knobs
        self.candidate_selector = CandidateSelector(config.target.vocab_size, config.hidden_size, knobs.selector_rank, knobs.selector_init)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "candidate_selector"):
            self.candidate_selector.reset_parameters()

    def teacher_predecessors(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """p_k = x_{a+k-1}, the dataset token; slot 0 reuses the anchor. [2,3,4,5] -> [2,2,3,4]."""
        return torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1).reshape(-1)

    def extra_objective(self, out: BlockForward, unary_loss: torch.Tensor, candidate_ids: torch.Tensor, target_logprobs: torch.Tensor) -> tuple[torch.Tensor, MetricCounts]:
        """L = L_unary + alpha_sel * L_sel, with L_sel a K-way CE over the (injected) unary top-K."""
        target_ids = target_logprobs.argmax(-1)
        predecessors = self.teacher_predecessors(out.block_tokens)
        injected_ids, labels = inject_target(candidate_ids, target_ids)
        selector_loss = self.weighted_loss(
            losses.selector_cross_entropy(self.candidate_selector.scores(out.unary_logits, out.hidden, predecessors, injected_ids), labels),
            out.mask,
        )
        loss = unary_loss + self.knobs.selector_loss_alpha * selector_loss if self.knobs.selector_loss_alpha > 0 else unary_loss

        with torch.no_grad():
            first = self.shared.first_draft_slot
            teacher_forced = self.candidate_selector.scores(out.unary_logits, out.hidden, predecessors, candidate_ids)
            size = self.block_size
            walk = self.candidate_selector.walk(
                out.unary_logits.gather(-1, candidate_ids).view(-1, size, self.candidate_top_k)[:, first:],
                candidate_ids.view(-1, size, self.candidate_top_k)[:, first:],
                out.hidden.view(-1, size, out.hidden.shape[-1])[:, first:],
                out.block_tokens[:, 0],
            )
            counts = selector_counts(teacher_forced, candidate_ids, target_logprobs, out.mask, walk.tokens, injected_ids, size, first)
        pool(counts, scalar_counts({"selector_loss": selector_loss}))
        return loss, counts

    def propose_from_hidden(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator) -> Proposal:
        """The selector walk over the unary top-K: greedy at T=0, sampled with realized rows at T>0."""
        candidate_unary, candidate_ids = logits.topk(self.candidate_top_k, dim=-1)
        walk = self.candidate_selector.walk(
            candidate_unary[None], candidate_ids[None], hidden[None],
            torch.tensor([anchor_id], device=hidden.device), temperature, generator,
        )
        return Proposal(walk.tokens[0], None if walk.probs is None else walk.probs[0], candidate_ids)
