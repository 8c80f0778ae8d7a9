"""DSpark: DFlash's parallel backbone + a serial low-rank Markov head and a confidence head.

The Markov head (the vanilla form) adds a bias to each slot's base logits that depends on the token before
it in the block: W2 · W1[previous token], rank r. The confidence head reads [backbone hidden | W1[previous
token]] and predicts the probability that the slot's draft is accepted. Training teacher-forces both on the
dataset's tokens and minimises a weighted token loss on the corrected logits (CE + total variation,
published 0.1 / 0.9 on NeMo's L1 distance) plus a BCE of the confidence against each slot's acceptance
probability sum_v min(p_v, q_v). Drafting walks: each drawn token is the next slot's previous token, and the
confidences it yields let `evaluate` cut the draft where their running product falls below a threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from algorithms import losses
from algorithms.dflash import BlockForward, DFlashDraft, Proposal
from algorithms.knobs import DSparkKnobs
from algorithms.metrics import (
    CONFIDENCE_ABS_ERROR,
    CONFIDENCE_LOSS,
    FINAL_LOSS,
    MetricCounts,
    pair,
    pool,
    scalar_counts,
)
from algorithms.modeling import DraftConfig
from algorithms.sampling import draw

if TYPE_CHECKING:
    from algorithms.registry import AlgorithmConfig


class MarkovHead(nn.Module):
    """The vanilla Markov head: a rank-r logit bias from the previous token alone."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def reset_parameters(self) -> None:
        """W1 small, W2 zero: the bias is zero until training moves it, so a fresh DSpark drafts as DFlash."""
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit from [backbone hidden | the Markov embedding of the previous token]."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, hidden: torch.Tensor, previous_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, previous_embedding.to(hidden.dtype)], dim=-1)).squeeze(-1).float()


class DSparkDraft(DFlashDraft):
    """The DSpark draft. Its loss is on the corrected logits only, so the unary head runs for metrics."""

    trains_unary_head = False

    def __init__(
        self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor
    ) -> None:
        super().__init__(config, algorithm, embed_weight, head_weight)
        knobs: DSparkKnobs = algorithm.knobs
        self.knobs = knobs
        self.markov_head = MarkovHead(config.target.vocab_size, knobs.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size + knobs.markov_rank)
        self.markov_head.reset_parameters()

    def export_fields(self) -> dict[str, int | str | None]:
        """The Markov head as NeMo AutoModel and llama.cpp's converter name it (the vanilla form)."""
        return {"markov_head_type": "vanilla", "markov_rank": self.knobs.markov_rank}

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.markov_head.reset_parameters()
        self.confidence_head.proj.reset_parameters()

    def step(self, base_logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor):
        """One slot (or many, teacher-forced): corrected logits and the confidence logit, given the previous
        tokens."""
        embedding = self.markov_head.markov_w1(previous)
        logits = base_logits + self.markov_head.markov_w2(embedding).float()
        return logits, self.confidence_head(hidden, embedding)

    def objective(self, out: BlockForward) -> tuple[torch.Tensor, MetricCounts]:
        """Token loss on the teacher-forced corrected logits + the weighted BCE of the confidence head."""
        # Slot k reads the token before its target: block_tokens[k - first_slot] (slot 0 wraps, masked in
        # anchor mode).
        previous = out.block_tokens.roll(self.first_slot, dims=1).reshape(-1)
        base_logits = self.output_logits(out.hidden)
        final_logits, confidence_logits = self.step(base_logits, out.hidden, previous)
        token_loss, final_logprobs, target_logprobs = self.full_vocabulary_loss(final_logits, out)
        with torch.no_grad():
            acceptance = losses.overlap(final_logprobs, target_logprobs)  # the BCE's targets
        bce = F.binary_cross_entropy_with_logits(confidence_logits, acceptance, reduction="none")
        confidence_loss = self.weighted_loss(bce, out.mask)
        loss = token_loss + self.knobs.confidence_loss_weight * confidence_loss
        with torch.no_grad():
            walked, _, _ = self.walk(
                self.draft_slots(base_logits), self.draft_slots(out.hidden), out.block_tokens[:, 0]
            )
            counts = self.realized_counts(walked, out)
            error = (torch.sigmoid(confidence_logits) - acceptance).abs()
            supervised = out.mask.sum()
            pool(counts, scalar_counts({FINAL_LOSS: token_loss, CONFIDENCE_LOSS: confidence_loss}, supervised))
            pool(counts, {CONFIDENCE_ABS_ERROR: pair((error * out.mask).sum(), supervised)})
        return loss, counts

    def walk(
        self,
        base_logits: torch.Tensor,  # [N, S, V] transformed base logits of the draft slots
        hidden: torch.Tensor,  # [N, S, H] their final-normed states
        anchors: torch.Tensor,  # [N] the blocks' anchor tokens: the first slot's previous token
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Self-conditioned drafting: each drawn token is the next slot's previous token. Returns the tokens
        [N, S], at T > 0 the distributions [N, S, V] they were drawn from (else None), and the confidences
        [N, S] (probabilities)."""
        previous = anchors
        tokens, rows, confidences = [], [], []
        for slot in range(base_logits.shape[1]):
            logits, confidence = self.step(base_logits[:, slot], hidden[:, slot], previous)
            previous, probs = draw(logits, temperature, generator)
            tokens.append(previous)
            confidences.append(torch.sigmoid(confidence))
            if probs is not None:
                rows.append(probs)
        return torch.stack(tokens, 1), torch.stack(rows, 1) if rows else None, torch.stack(confidences, 1)

    def propose_from_hidden(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator
    ) -> Proposal:
        """The walk for one block, with each slot's predicted acceptance for a scheduled verification."""
        anchor = torch.tensor([anchor_id], device=hidden.device)
        tokens, probs, confidence = self.walk(logits[None], hidden[None], anchor, temperature, generator)
        return Proposal(tokens[0], None if probs is None else probs[0], None, confidence[0])
