"""Per-position losses, position weighting and the reduction. Everything runs in fp32."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NLA_EPS = 1e-5
LOSS_EPS = 1e-5  # keeps a batch without supervised positions at loss 0


def denominator(mask: torch.Tensor) -> torch.Tensor:
    """What every loss term is divided by: the supervised positions of the batch, sum(m) + 1e-5."""
    return mask.sum() + LOSS_EPS


LK_HYBRID_ETA = 3.0


def overlap_of_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p_v, q_v): the acceptance probability of q under p at temperature 1."""
    return torch.minimum(draft_probs, target_probs).sum(-1)


def overlap(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    return overlap_of_probs(draft_logprobs.exp(), target_logprobs.exp())


def kl_div(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    p = target_logprobs.exp()
    return (p * (target_logprobs - draft_logprobs)).sum(-1)


def reverse_kl(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    q = draft_logprobs.exp()
    return (q * (draft_logprobs - target_logprobs)).sum(-1)


def jensen_shannon(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    log_mid = torch.logaddexp(draft_logprobs, target_logprobs) - math.log(2.0)
    p, q = target_logprobs.exp(), draft_logprobs.exp()
    return 0.5 * (p * (target_logprobs - log_mid)).sum(-1) + 0.5 * (q * (draft_logprobs - log_mid)).sum(-1)


def hard_cross_entropy(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    """-log q[argmax p], the first argmax of the target."""
    label = target_logprobs.argmax(-1, keepdim=True)
    return -draft_logprobs.gather(-1, label).squeeze(-1)


def total_variation(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    return 1.0 - overlap(draft_logprobs, target_logprobs)


def negative_log_acceptance(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    return -overlap(draft_logprobs, target_logprobs).clamp(min=NLA_EPS).log()


def lk_hybrid(draft_logprobs: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    alpha = overlap(draft_logprobs, target_logprobs)
    mix = torch.exp(-LK_HYBRID_ETA * alpha.detach())
    return mix * kl_div(draft_logprobs, target_logprobs) + (1 - mix) * (1 - alpha)


PER_POSITION_LOSSES: dict[str, LossFn] = {
    "kl_div": kl_div,
    "rkl": reverse_kl,
    "jsd": jensen_shannon,
    "ce": hard_cross_entropy,
    "tv": total_variation,
    "nla": negative_log_acceptance,
    "lk_hybrid": lk_hybrid,
}


def _kl_div_closed_form(draft_logprobs, target_logprobs, draft_probs, target_probs, target_ids):
    log_ratio = target_logprobs - draft_logprobs
    value = log_ratio.mul_(target_probs).sum(-1)
    return value, draft_probs.sub_(target_probs)


def _cross_entropy_closed_form(draft_logprobs, target_logprobs, draft_probs, target_probs, target_ids):
    rows = torch.arange(target_ids.shape[0], device=target_ids.device)
    draft_probs[rows, target_ids] -= 1.0
    return -draft_logprobs[rows, target_ids], draft_probs


# Per-position value and d loss / d draft logits in closed form (softmax minus the target), from
# (draft_logprobs, target_logprobs, draft_probs, target_probs, target_ids), for the losses that have
# one. The gradient is written into draft_probs, to keep one [rows, vocab] tensor fewer alive.
CLOSED_FORM_LOSSES = {
    "kl_div": _kl_div_closed_form,
    "ce": _cross_entropy_closed_form,
}


def fixed_exp_decay_weights(slots: torch.Tensor, gamma: float, sample_from_anchor: bool) -> torch.Tensor:
    """omega_k = exp(-(k-1)/gamma) with omega_0 = 0 (anchor mode), or exp(-k/gamma)."""
    slots = slots.float()
    if sample_from_anchor:
        return torch.exp(-slots / gamma)
    return torch.exp(-(slots - 1).clamp(min=0) / gamma) * (slots != 0).float()


def uniform_weights(slots: torch.Tensor, sample_from_anchor: bool) -> torch.Tensor:
    """omega_k = 1 on every predicted slot (no decay; JetSpec's forward KL), omega_0 = 0 in anchor mode."""
    return torch.ones_like(slots, dtype=torch.float32) if sample_from_anchor else (slots != 0).float()


@torch.no_grad()
def dpace_weights(per_position_ce: torch.Tensor, mask: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE: omega_k = m_k * sum_{j>=k} m_j * prod_{i<=j} s_i.

    s_i = (1-alpha) exp(-ce_i) + alpha on masked-in slots.
    """
    confidence = torch.exp(-per_position_ce.float() * mask).view(-1, block_size)
    block_mask = mask.view(-1, block_size)
    smoothed = torch.where(block_mask > 0, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = smoothed.cumprod(-1) * block_mask
    suffix_sums = prefix.flip(-1).cumsum(-1).flip(-1)
    return (block_mask * suffix_sums).view(-1)


def reduce_weighted(per_position: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(w * m * l) / (sum(m) + 1e-5): the denominator is the unweighted mask count."""
    return (weights * mask * per_position).sum() / denominator(mask)


def position_weights(
    per_position: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    scheme: str,
    gamma: float,
    dpace_alpha: float,
    sample_from_anchor: bool,
) -> torch.Tensor:
    """The weights of one term; D-PACE reads them from that term's own CE."""
    if scheme == "dpace":
        return dpace_weights(per_position, mask, block_size, dpace_alpha)
    if scheme == "uniform":
        return uniform_weights(slots, sample_from_anchor)
    return fixed_exp_decay_weights(slots, gamma, sample_from_anchor)


def selector_cross_entropy(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """K-way hard CE over candidate scores [M, K]: logsumexp(s) - s[label]."""
    scores = scores.float()
    return torch.logsumexp(scores, -1) - scores.gather(-1, labels[:, None]).squeeze(-1)
