"""Low-rank candidate selector: re-ranks the unary top-K given the previous token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.sampling import draw


class CandidateSelector(nn.Module):
    """score(p, c) = U[c] + sum_r A[p, r] (W_h h)_r S[c, r]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, init: str = "zero_successor") -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.init = init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A zero successor codebook makes a fresh selector a no-op, so DFlash2 starts exactly as DFlash."""
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)
        if self.init == "normal":
            nn.init.normal_(self.successor_codebook, std=0.02)
        else:
            nn.init.zeros_(self.successor_codebook)

    def successors(self, candidate_ids: torch.Tensor) -> torch.Tensor:
        """S[c] for candidates [..., K] -> [..., K, R], fp32."""
        # F.embedding: its backward accumulates rows far faster than indexing's on CPU.
        return F.embedding(candidate_ids, self.successor_codebook).float()

    def transition(
        self, projected_hidden: torch.Tensor, predecessor_ids: torch.Tensor, successors: torch.Tensor
    ) -> torch.Tensor:
        """[..., K] transition scores after predecessors [...], from W_h h [..., R] and S[c] [..., K, R]; fp32."""
        context = F.embedding(predecessor_ids, self.predecessor_codebook).float() * projected_hidden.float()
        return torch.einsum("...r,...kr->...k", context, successors)

    def scores(
        self,
        candidate_unary: torch.Tensor,
        hidden: torch.Tensor,
        predecessor_ids: torch.Tensor,
        candidate_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Teacher-forced scores of candidates [M, K] from their transformed unary logits [M, K]."""
        return candidate_unary.float() + self.transition(
            self.hidden_projection(hidden), predecessor_ids, self.successors(candidate_ids)
        )

    def walk(
        self,
        candidate_unary: torch.Tensor,  # [N, S, K] unary logits of the candidates, descending
        candidate_ids: torch.Tensor,  # [N, S, K]
        hidden: torch.Tensor,  # [N, S, H] final-normed hidden of the draft slots
        anchor_ids: torch.Tensor,  # [N]
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> SelectorPath:
        """Walk slot by slot from the anchor, feeding each selected token forward (see `walk_projected`)."""
        return self.walk_projected(
            candidate_unary,
            candidate_ids,
            self.hidden_projection(hidden),
            self.successors(candidate_ids),
            anchor_ids,
            temperature,
            generator,
        )

    def walk_projected(
        self,
        candidate_unary: torch.Tensor,  # [N, S, K]
        candidate_ids: torch.Tensor,  # [N, S, K]
        projected_hidden: torch.Tensor,  # [N, S, R] W_h h of the draft slots
        successors: torch.Tensor,  # [N, S, K, R] S[c] of the candidates
        anchor_ids: torch.Tensor,  # [N]
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> SelectorPath:
        """The walk from precomputed projections, which training shares with its teacher-forced scores.

        Greedy at temperature 0 (first index on ties = highest unary); otherwise sample over the
        K candidates from softmax(score / T) and keep each realized row for rejection sampling.
        """
        previous = anchor_ids
        tokens, rows = [], []
        for slot in range(candidate_ids.shape[1]):
            score = candidate_unary[:, slot].float() + self.transition(
                projected_hidden[:, slot], previous, successors[:, slot]
            )
            choice, probs = draw(score, temperature, generator)
            if probs is not None:
                rows.append(probs)
            previous = candidate_ids[:, slot].gather(-1, choice[:, None]).squeeze(-1)
            tokens.append(previous)
        return SelectorPath(
            tokens=torch.stack(tokens, dim=1),
            candidate_ids=candidate_ids,
            probs=torch.stack(rows, dim=1) if rows else None,
        )


@dataclass
class SelectorPath:
    tokens: torch.Tensor  # [N, S] the selected token per draft slot
    candidate_ids: torch.Tensor  # [N, S, K]
    probs: torch.Tensor | None  # [N, S, K] realized q rows (sampling only)
