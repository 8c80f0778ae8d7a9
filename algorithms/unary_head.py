"""The unary head: draft vs target logits through the frozen LM head, the unary loss and per-row statistics.

It runs over chunks of whole blocks and never holds more than one chunk of [rows, vocab] logits per
side. The unary loss is a sum of per-row terms, so the gradient w.r.t. the draft hidden states is
computed chunk by chunk during the forward pass (KL and CE in closed form, the other losses by
autograd within the chunk); backward only scales it, and nothing is recomputed.
Rows the aligned mask drops (slot 0, padding anchors, unsupervised tokens) never reach the head, and
target rows shared by overlapping blocks are projected once per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms import losses

# Elements of one [rows, vocab] chunk: 4M fp32 = 16 MiB, small enough to stay in cache-sized pieces on
# CPU, large enough for efficient GEMMs.
CHUNK_ELEMENTS = 2**22


@dataclass(frozen=True)
class UnaryObjective:
    """The compound unary loss and its position weighting (per-position losses and weighting)."""

    loss_weights: dict[str, float]
    position_weighting: str
    decay_gamma: float
    dpace_alpha: float
    sample_from_anchor: bool
    block_size: int
    top_k: int

    def weights(self, per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Weights over whole blocks; D-PACE reads them from the term's own per-position loss."""
        slots = torch.arange(mask.shape[0], device=mask.device) % self.block_size
        return losses.position_weights(
            per_position,
            mask,
            slots,
            self.block_size,
            self.position_weighting,
            self.decay_gamma,
            self.dpace_alpha,
            self.sample_from_anchor,
        )


@dataclass
class RowStatistics:
    """What the metrics need from one row's full-vocabulary distributions, in [rows] or [rows, K]."""

    draft_ids: torch.Tensor  # unary argmax
    target_ids: torch.Tensor  # target argmax (first on ties)
    candidate_ids: torch.Tensor  # unary top-K, descending
    candidate_logits: torch.Tensor  # transformed unary logits of the candidates
    target_token_logits: torch.Tensor  # transformed unary logit of the target token
    target_candidate_logprobs: torch.Tensor  # target log-probs of the candidates
    target_max_logprobs: torch.Tensor  # target log-prob of the target token
    overlap: torch.Tensor  # alpha = sum_v min(p_v, q_v)


def row_statistics(
    draft_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_probs: torch.Tensor,
    top_k: int,
) -> RowStatistics:
    """Per-row statistics of transformed draft logits and fp32 distributions over the full vocabulary."""
    candidate_logits, candidate_ids = draft_logits.topk(top_k, dim=-1)
    target_max_logprobs, target_ids = target_logprobs.max(-1)
    return RowStatistics(
        draft_ids=draft_logits.argmax(-1),
        target_ids=target_ids,
        candidate_ids=candidate_ids,
        candidate_logits=candidate_logits,
        target_token_logits=draft_logits.gather(-1, target_ids[:, None]).squeeze(-1),
        target_candidate_logprobs=target_logprobs.gather(-1, candidate_ids),
        target_max_logprobs=target_max_logprobs,
        overlap=losses.overlap_of_probs(draft_probs, target_probs),
    )


@dataclass
class UnaryHead:
    """The head's outputs for all M rows (rows outside the mask hold zeros and must stay masked)."""

    loss: torch.Tensor  # differentiable compound unary loss
    terms: dict[str, torch.Tensor]  # each term's value, detached
    stats: RowStatistics  # candidate_logits and target_token_logits are differentiable


COMPACTING_DEVICE_TYPES = ("cpu",)


def unary_head(
    hidden: torch.Tensor,  # [M, H] final-normed draft states
    target_hidden: torch.Tensor,  # [T, H] target final hidden states of the row
    target_rows: torch.Tensor,  # [M] which target row supervises each draft row
    mask: torch.Tensor,  # [M] aligned loss mask
    head_weight: torch.Tensor,  # [V, H] frozen verifier head
    logit_transform: Callable[[torch.Tensor], torch.Tensor],
    objective: UnaryObjective,
) -> UnaryHead:
    """The compound unary loss with position weighting, plus the per-row statistics, chunk by chunk."""
    rows, block, top_k = hidden.shape[0], objective.block_size, objective.top_k
    needs_grad = hidden.requires_grad and torch.is_grad_enabled()
    stats = _empty_statistics(rows, top_k, hidden.device)
    raw_gathered = torch.zeros(rows, top_k + 1, device=hidden.device)
    term_sums = {name: torch.zeros((), device=hidden.device) for name in objective.loss_weights}
    loss_grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_grad else None
    denominator = losses.denominator(mask)
    chunk_rows = max(1, CHUNK_ELEMENTS // (head_weight.shape[0] * block)) * block
    # Under autocast the head GEMMs run in its dtype; cast the frozen head once, not once per chunk.
    device_type = hidden.device.type
    # (a device type without autocast, like the `meta` stand-in CI runs accelerator paths on, computes in fp32)
    autocasting = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocasting else torch.float32
    compute_head = head_weight.to(compute_dtype)
    # KL and CE have closed-form logit gradients (softmax minus the target); other losses go through autograd.
    closed_form = all(name in losses.CLOSED_FORM_LOSSES for name in objective.loss_weights)
    use_autograd = needs_grad and not closed_form
    grad_mode = lambda: torch.enable_grad() if use_autograd else torch.no_grad()  # noqa: E731
    # Compacting a chunk to its supervised rows needs their count on the host. That is free on a CPU and
    # saves head GEMMs there; on an accelerator it would stall the queue once per chunk, so every row of
    # the chunk goes through the head (fixed shapes) and the mask zeroes the unsupervised ones.
    compact = device_type in COMPACTING_DEVICE_TYPES
    for start in range(0, rows, chunk_rows):
        chunk_mask = mask[start : start + chunk_rows]
        if compact:
            supervised = chunk_mask.nonzero().squeeze(-1)
            if supervised.numel() == 0:
                continue
        else:
            supervised = torch.arange(chunk_mask.shape[0], device=chunk_mask.device)
        rows_out = start + supervised
        with grad_mode():
            draft_hidden = hidden[rows_out].detach().requires_grad_(use_autograd)
            raw_logits = F.linear(
                draft_hidden.to(compute_dtype), compute_head
            ).float()  # fp32 before any softmax, even under autocast
            draft_logits = logit_transform(raw_logits)
            draft_logprobs = torch.log_softmax(draft_logits, dim=-1)
        with torch.no_grad():
            target_logprobs = _target_logprobs(
                target_hidden, target_rows[rows_out], compute_head, logit_transform, compact
            )
            draft_probs, target_probs = draft_logprobs.detach().exp(), target_logprobs.exp()
            chunk = row_statistics(draft_logits.detach(), draft_probs, target_logprobs, target_probs, top_k)
            for field in RowStatistics.__dataclass_fields__:
                getattr(stats, field)[rows_out] = getattr(chunk, field)
            raw_gathered[rows_out] = raw_logits.detach().gather(
                -1, torch.cat([chunk.candidate_ids, chunk.target_ids[:, None]], 1)
            )
        if not use_autograd:
            del draft_logits  # the chunk holds as few [rows, vocab] tensors as it can

        chunk_loss, grad_logits = torch.zeros((), device=hidden.device), None
        for term, (name, weight) in enumerate(objective.loss_weights.items()):
            with grad_mode():
                if closed_form:
                    # The closed forms overwrite draft_probs; only the last term may have it.
                    last = term == len(objective.loss_weights) - 1
                    supervised_loss, term_grad = losses.CLOSED_FORM_LOSSES[name](
                        draft_logprobs,
                        target_logprobs,
                        draft_probs if last else draft_probs.clone(),
                        target_probs,
                        chunk.target_ids,
                    )
                else:
                    supervised_loss, term_grad = losses.PER_POSITION_LOSSES[name](draft_logprobs, target_logprobs), None
                per_position = torch.zeros(chunk_mask.shape, device=hidden.device).index_put(
                    (supervised,), supervised_loss
                )
                scale = objective.weights(per_position.detach(), chunk_mask) * chunk_mask
                term_sum = (scale * per_position).sum()
            term_sums[name] += term_sum.detach()
            if use_autograd:
                chunk_loss = chunk_loss + weight * term_sum
            elif needs_grad:
                term_grad.mul_((weight * scale[supervised] / denominator)[:, None])
                grad_logits = term_grad if grad_logits is None else grad_logits.add_(term_grad)
            del term_grad
        del draft_probs, target_probs, target_logprobs, draft_logprobs
        if use_autograd:
            (grad,) = torch.autograd.grad(chunk_loss, draft_hidden)
            loss_grad[rows_out] = grad / denominator
        elif needs_grad:
            grad_raw = _through_transform(logit_transform, raw_logits, grad_logits)
            loss_grad[rows_out] = (grad_raw.to(compute_dtype) @ compute_head).float()
    terms = {name: value / denominator for name, value in term_sums.items()}
    loss_value = sum(weight * terms[name] for name, weight in objective.loss_weights.items())
    gathered_ids = torch.cat([stats.candidate_ids, stats.target_ids[:, None]], dim=1)
    loss, gathered_logits = _HeadGradient.apply(
        hidden, loss_value, raw_gathered, loss_grad, gathered_ids, mask, head_weight, logit_transform
    )
    stats.candidate_logits, stats.target_token_logits = gathered_logits[:, :top_k], gathered_logits[:, top_k]
    return UnaryHead(loss=loss, terms=terms, stats=stats)


def _target_logprobs(
    target_hidden, rows: torch.Tensor, compute_head: torch.Tensor, logit_transform, compact: bool
) -> torch.Tensor:
    """fp32 target log-probs for each row. Compacting, rows shared by overlapping blocks go through the head
    once; on an accelerator every row does, since `unique`'s output size would have to be read back."""
    unique_rows, inverse = torch.unique(rows, return_inverse=True) if compact else (rows, None)
    logits = logit_transform(F.linear(target_hidden[unique_rows].to(compute_head.dtype), compute_head).float())
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs if inverse is None else logprobs[inverse]


def _empty_statistics(rows: int, top_k: int, device: torch.device) -> RowStatistics:
    ids = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
    values = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
    return RowStatistics(
        ids(rows),
        ids(rows),
        ids(rows, top_k),
        values(rows, top_k),
        values(rows),
        values(rows, top_k),
        values(rows),
        values(rows),
    )


def _through_transform(logit_transform, raw_logits: torch.Tensor, grad_logits: torch.Tensor) -> torch.Tensor:
    """Backpropagate a gradient w.r.t. transformed logits to the raw head outputs."""
    with torch.enable_grad():
        raw = raw_logits.detach().requires_grad_(True)
        transformed = logit_transform(raw)
        if transformed is raw:  # the identity transform: nothing to differentiate
            return grad_logits
        (grad_raw,) = torch.autograd.grad(transformed, raw, grad_logits)
    return grad_raw


class _HeadGradient(torch.autograd.Function):
    """Connects the chunked head to autograd: the loss gradient was computed in the forward pass, and the
    gathered logits (candidates + target token) backpropagate through the frozen head rows they came from."""

    @staticmethod
    def forward(ctx, hidden, loss_value, raw_gathered, loss_grad, gathered_ids, mask, head_weight, logit_transform):
        ctx.save_for_backward(raw_gathered, loss_grad, gathered_ids, mask, head_weight)
        ctx.logit_transform, ctx.hidden_dtype = logit_transform, hidden.dtype
        with torch.no_grad():
            gathered_logits = logit_transform(raw_gathered)
        return loss_value.clone(), gathered_logits

    @staticmethod
    def backward(ctx, grad_loss, grad_gathered):
        raw_gathered, loss_grad, gathered_ids, mask, head_weight = ctx.saved_tensors
        grad_hidden = loss_grad * grad_loss
        if grad_gathered is not None:
            # Rows outside the mask hold placeholder ids: they must not backpropagate.
            grad_raw = _through_transform(ctx.logit_transform, raw_gathered, grad_gathered) * (mask > 0)[:, None]
            grad_hidden = grad_hidden + F.embedding_bag(
                gathered_ids, head_weight, per_sample_weights=grad_raw, mode="sum"
            )
        return grad_hidden.to(ctx.hidden_dtype), None, None, None, None, None, None, None
