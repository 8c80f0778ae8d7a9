"""Domino: DFlash's parallel backbone + a causal correction head over the block's previous tokens.

A one-layer GRU reads the tokens that precede each slot inside its block; a low-rank projection of
[backbone hidden | GRU state] adds a logit delta to the slot's unary (base) logits. Training teacher-forces the
GRU on the dataset's tokens and mixes the two losses, (1 - lambda) * loss(final) + lambda * loss(base), with
lambda falling linearly from 1 to 0 over the first `domino_lambda_decay_ratio` of training. Drafting walks: each
slot's token feeds the next slot's GRU step, which is the path `realized` measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.dflash import BlockForward, DFlashDraft, Proposal
from algorithms.knobs import DominoKnobs
from algorithms.metrics import FINAL_LOSS, MetricCounts, pool, scalar_counts
from algorithms.modeling import DraftConfig
from algorithms.sampling import draw

if TYPE_CHECKING:
    from algorithms.registry import AlgorithmConfig


def domino_lambda(step: int, total_steps: int, decay_ratio: float) -> float:
    """The base loss's weight: 1 at step 0, falling linearly to 0 at `decay_ratio` of training, then 0."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    return max(0.0, 1.0 - min(step / decay_steps, 1.0))


class DominoDraft(DFlashDraft):
    """The Domino draft. Its delta starts at zero, so a fresh Domino drafts exactly as DFlash does."""

    def __init__(
        self, config: DraftConfig, algorithm: AlgorithmConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor
    ) -> None:
        super().__init__(config, algorithm, embed_weight, head_weight)
        knobs: DominoKnobs = algorithm.knobs
        self.knobs = knobs
        hidden, vocab = config.hidden_size, config.target.vocab_size
        self.prefix_gru = nn.GRU(hidden, knobs.domino_gru_size, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + knobs.domino_gru_size, knobs.domino_rank, bias=False),
            nn.SiLU(),
            nn.Linear(knobs.domino_rank, vocab, bias=False),
        )
        self.base_weight = 1.0  # lambda; `set_training_progress` moves it
        self._init_delta()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.prefix_gru.reset_parameters()
        self._init_delta()

    def _init_delta(self) -> None:
        """The projection's first layer small, its last zero: the delta is zero until training moves it."""
        nn.init.normal_(self.embed_proj[0].weight, std=0.02)
        nn.init.zeros_(self.embed_proj[2].weight)

    def set_training_progress(self, step: int, total_steps: int) -> None:
        self.base_weight = domino_lambda(step, total_steps, self.knobs.domino_lambda_decay_ratio)

    @property
    def first_corrected_slot(self) -> int:
        """Slots before it keep their base logits (NeMo's `pure_draft_prefix_len`)."""
        return self.shared.first_draft_slot + self.knobs.domino_pure_prefix

    def logit_delta(self, hidden: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced deltas [M, V]: slot k's GRU has read the block's dataset tokens before its target."""
        blocks, size = block_tokens.shape
        first, corrected = self.shared.first_draft_slot, self.first_corrected_slot
        # Slot k predicts the token after block_tokens[k - first]: the GRU reads block_tokens[0 .. k - first].
        read = self.embed_weight[block_tokens[:, : size - first]].to(hidden.dtype)
        states, _ = self.prefix_gru(read)
        slot_states = states[:, corrected - first :]
        slot_hidden = hidden.view(blocks, size, -1)[:, corrected:]
        delta = self.embed_proj(torch.cat([slot_hidden, slot_states.to(hidden.dtype)], dim=-1)).float()
        return F.pad(delta, (0, 0, corrected, 0)).view(blocks * size, -1)

    def objective(self, out: BlockForward) -> tuple[torch.Tensor, MetricCounts]:
        """(1 - lambda) * loss(final logits) + lambda * loss(base logits), the same loss terms and weighting."""
        base_logits = self.output_logits(out.hidden)
        final_loss, _, _ = self.full_vocabulary_loss(base_logits + self.logit_delta(out.hidden, out.block_tokens), out)
        loss = (1.0 - self.base_weight) * final_loss + self.base_weight * out.head.loss
        with torch.no_grad():
            walked, _ = self.walk(self.draft_slots(base_logits), self.draft_slots(out.hidden), out.block_tokens[:, 0])
            counts = self.realized_counts(walked, out)
        pool(counts, scalar_counts({FINAL_LOSS: final_loss}, out.mask.sum()))
        return loss, counts

    def walk(
        self,
        base_logits: torch.Tensor,  # [N, S, V] transformed base logits of the draft slots
        hidden: torch.Tensor,  # [N, S, H] their final-normed states
        anchors: torch.Tensor,  # [N] the blocks' anchor tokens: what the first slot's GRU step reads
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-conditioned drafting: slot by slot, each drawn token is the next GRU input (the pure-prefix
        slots' too, though their logits stay the base ones). Returns the tokens [N, S] and, at T > 0, the
        distributions [N, S, V] they were drawn from (None at T = 0)."""
        corrected = self.knobs.domino_pure_prefix
        read, state = anchors, None
        tokens, rows = [], []
        for slot in range(base_logits.shape[1]):
            logits = base_logits[:, slot]
            output, state = self.prefix_gru(self.embed_weight[read][:, None].to(hidden.dtype), state)
            if slot >= corrected:
                delta = self.embed_proj(torch.cat([hidden[:, slot], output[:, 0].to(hidden.dtype)], dim=-1))
                logits = logits + delta.float()
            read, probs = draw(logits, temperature, generator)
            tokens.append(read)
            if probs is not None:
                rows.append(probs)
        return torch.stack(tokens, 1), torch.stack(rows, 1) if rows else None

    def propose_from_hidden(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int, temperature: float, generator
    ) -> Proposal:
        """The walk for one block; at T > 0 each slot's distribution is conditioned on the tokens drawn before."""
        anchor = torch.tensor([anchor_id], device=hidden.device)
        tokens, probs = self.walk(logits[None], hidden[None], anchor, temperature, generator)
        return Proposal(tokens[0], None if probs is None else probs[0], None)
