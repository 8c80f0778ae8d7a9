"""Speculative decoding with the real target, batch size 1: measured acceptance, lossless.

Each cycle drafts one block [verified token, MASK x (B-1)] from the context features, the target
verifies it in one forward pass, and the accepted prefix plus a bonus token is committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from algorithms.dflash import DFlashDraft, Proposal
from harness.features import target_features


@dataclass
class Verification:
    accepted: int  # a: leading draft tokens accepted
    bonus: int  # the token the target emits after them


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verification:
    """Longest prefix with d_i = argmax L_{i-1}; the bonus is the target's argmax after it."""
    greedy = target_logits.argmax(-1)  # [S+1]
    matches = (draft_tokens == greedy[:-1]).long().cumprod(0)
    accepted = int(matches.sum())
    return Verification(accepted, int(greedy[accepted]))


def verify_sampled(target_probs: torch.Tensor, proposal: Proposal, generator: torch.Generator | None) -> Verification:
    """Lossless rejection sampling: accept d_i iff u * q_i(d_i) < p_{i-1}(d_i).

    For DFlash2, q_i is the selector's realized distribution over its K candidates, conditioned on
    the sampled predecessor, scattered onto the vocabulary; never the unary softmax.
    """
    vocab = target_probs.shape[-1]
    for slot in range(proposal.tokens.shape[0]):
        token = int(proposal.tokens[slot])
        q_full = realized_distribution(proposal, slot, vocab)
        u = float(torch.rand((), generator=generator))
        if u * float(q_full[token]) < float(target_probs[slot, token]):
            continue
        residual = (target_probs[slot] - q_full).clamp(min=0)
        source = residual if float(residual.sum()) > 0 else target_probs[slot]
        return Verification(slot, int(torch.multinomial(source / source.sum(), 1, generator=generator)))
    last = proposal.tokens.shape[0]
    return Verification(last, int(torch.multinomial(target_probs[last], 1, generator=generator)))


def realized_distribution(proposal: Proposal, slot: int, vocab: int) -> torch.Tensor:
    """q̃: the proposal row for `slot` over the whole vocabulary (zero outside DFlash2's candidates)."""
    row = proposal.probs[slot].float()
    if proposal.candidate_ids is None:
        return row
    return torch.zeros(vocab, dtype=row.dtype, device=row.device).scatter_add(0, proposal.candidate_ids[slot], row)


@dataclass
class DecodeStats:
    """Per-request record of one speculative generation."""

    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # tau per cycle, verified token included
    verified_tokens: list[int] = field(default_factory=list)  # tokens the target verified per cycle (anchor + drafts)
    slot_attempts: list[int] = field(default_factory=list)  # cycles in which slot i was reached
    slot_accepts: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def has_cycles(self) -> bool:
        """False when the request stopped before any draft-verify cycle (stop token first, or 1 new token)."""
        return bool(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tau over the request's cycles; undefined (nan) for a request without any."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.has_cycles else float("nan")


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


@torch.no_grad()
def speculative_generate(
    target_model: torch.nn.Module,
    draft: DFlashDraft,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    confidence_threshold: float = 0.0,
    max_draft: int | None = None,
    vocabulary: torch.Tensor | None = None,
) -> DecodeStats:
    """Generate up to `max_new_tokens` with the draft proposing and the target verifying (the prefix a
    confidence head schedules, at `confidence_threshold` > 0). `max_draft` drafts fewer tokens than the block and
    `vocabulary` only those token ids, as llama.cpp's `--spec-draft-n-max` and a reduced draft head do."""
    from transformers import DynamicCache

    draft.eval()
    device = next(target_model.parameters()).device
    layer_ids = draft.config.target_layer_ids
    slots = draft.block_size - draft.shared.first_draft_slot
    slots = slots if max_draft is None else min(slots, max_draft)
    stats = DecodeStats(slot_attempts=[0] * slots, slot_accepts=[0] * slots)
    started = time.perf_counter()

    cache = DynamicCache()
    prompt = torch.tensor([prompt_ids], device=device)
    out = target_model(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
    context = target_features(out.hidden_states, layer_ids)[0]
    logits = out.logits[0, -1]
    anchor = (
        int(logits.argmax())
        if temperature == 0
        else int(torch.multinomial(_probs(logits, temperature), 1, generator=generator))
    )
    stats.tokens.append(anchor)
    start = len(prompt_ids)
    stats.verify_seconds += time.perf_counter() - started

    while len(stats.tokens) < max_new_tokens and anchor not in stop_ids:
        remaining = max_new_tokens - len(stats.tokens)
        budget = min(slots, remaining)  # a shorter block near the limit, as Z Lab's loop drafts
        t0 = time.perf_counter()
        proposal = draft.propose(
            context, torch.arange(start, device=device), anchor, start, budget, temperature, generator, vocabulary
        ).scheduled(confidence_threshold)
        t1 = time.perf_counter()
        block = torch.cat([torch.tensor([anchor], device=device), proposal.tokens.to(device)])[None]
        out = target_model(input_ids=block, past_key_values=cache, use_cache=True, output_hidden_states=True)
        target_logits = out.logits[0]
        if temperature == 0:
            verdict = verify_greedy(target_logits, proposal.tokens)
        else:
            verdict = verify_sampled(_probs(target_logits, temperature), proposal, generator)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += time.perf_counter() - t1

        for slot in range(min(verdict.accepted + 1, proposal.tokens.shape[0])):  # the slots the target saw
            stats.slot_attempts[slot] += 1
        for slot in range(verdict.accepted):
            stats.slot_accepts[slot] += 1
        committed = [int(t) for t in proposal.tokens[: verdict.accepted]] + [verdict.bonus]
        produced = min(len(committed), remaining)
        stopped = next((i + 1 for i, token in enumerate(committed[:produced]) if token in stop_ids), None)
        produced = stopped or produced
        stats.tokens += committed[:produced]
        stats.acceptance_lengths.append(produced)  # tokens this cycle committed (Z Lab's convention at the end too)
        stats.verified_tokens.append(block.shape[1])
        rejected = cache.get_seq_length() - (start + verdict.accepted + 1)
        if rejected > 0:
            cache.crop(-rejected)  # keep the anchor and accepted drafts; drop rejected positions
        context = torch.cat([context, target_features(out.hidden_states, layer_ids)[0, : verdict.accepted + 1]])
        start += verdict.accepted + 1
        anchor = stats.tokens[-1]
    stats.total_seconds = time.perf_counter() - started
    return stats


@torch.no_grad()
def target_greedy(
    target_model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    batch_size: int = 20,
) -> list[list[int]]:
    """The target alone, greedy (the lossless reference), batched with left padding.

    Decoding is memory-bound on a CPU, so a batch costs about as much per step as one request.
    Each continuation ends at its first stop token or at `max_new_tokens`.
    """
    device = next(target_model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    continuations: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        output = target_model.generate(
            input_ids=ids.to(device),
            attention_mask=attention.to(device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=sorted(stop_ids),
        )
        for row in output[:, width:].tolist():
            tokens = []
            for token in row:
                tokens.append(token)
                if token in stop_ids:
                    break
            continuations.append(tokens)
    return continuations
