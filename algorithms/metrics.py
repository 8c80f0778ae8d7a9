"""Pooled metric counts: every metric is a (sum, total) pair, divided once at the end.

Metric names live here and nowhere else; the harness, studies and reports import them (the harness's
MLflow prefixes live in `harness.tracking`).
"""

from __future__ import annotations

import torch

from algorithms.blocks import draft_slots
from algorithms.unary_head import RowStatistics

PATHS = ("unary", "realized", "oracle")
UNARY_ACCEPTED_LENGTH = "unary_accepted_length"
REALIZED_ACCEPTED_LENGTH = "realized_accepted_length"
ORACLE_ACCEPTED_LENGTH = "oracle_accepted_length"
ACCEPTED_LENGTHS = (UNARY_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, ORACLE_ACCEPTED_LENGTH)
TEACHER_FORCED_SELECTOR_ACC = "teacher_forced_selector_acc"
UNARY_FULL_ACC = "unary_full_acc"
FINAL_LOSS = "final_loss"  # Domino, DSpark: the loss of the corrected (final) logits; `unary_loss` is the base's
CONFIDENCE_LOSS = "confidence_loss"  # DSpark: the confidence head's BCE against each slot's acceptance
CONFIDENCE_ABS_ERROR = "confidence_abs_error"  # mean |predicted - actual| acceptance probability per slot
# Measured by the harness, not pooled here, but named with the others.
DRAFT_STEP_MS = "draft_step_ms"
NUM_ANCHORS = "num_anchors"  # anchors a validation counted (the total of the accepted-length pairs)
NUM_DOCUMENTS = "num_documents"  # documents they came from: the units the standard errors cluster on
FINAL_VALIDATION_S = "final_validation_s"  # wall time of the final, every-anchor validation
SKIPPED_STEPS = "skipped_steps"  # optimizer steps skipped since the last log: micro-batches with no supervised slot
SE_SUFFIX = "_se"


def se_name(name: str) -> str:
    """The standard error logged next to its metric."""
    return f"{name}{SE_SUFFIX}"


# K (`candidate_top_k`) is a param of the run, not part of these names, so runs with different K share columns.
UNARY_CANDIDATE_RECALL = "unary_candidate_recall"
UNARY_CANDIDATE_TARGET_MASS = "unary_candidate_target_mass"
UNARY_CANDIDATE_TARGET_MASS_INJECTED = "unary_candidate_target_mass_injected"
# The metrics that carry a standard error and a 95% interval.
HEADLINE_METRICS = (
    *ACCEPTED_LENGTHS,
    UNARY_CANDIDATE_RECALL,
    UNARY_CANDIDATE_TARGET_MASS,
    TEACHER_FORCED_SELECTOR_ACC,
    UNARY_FULL_ACC,
)


def recall_position_name(slot: int) -> str:
    return f"{UNARY_CANDIDATE_RECALL}_position_{slot}"


def conditional_acc_name(path: str, slot: int) -> str:
    return f"{path}_position_{slot}_conditional_acc"


def unary_position_acc_name(slot: int) -> str:
    return f"unary_position_{slot}_acc"


MetricCounts = dict[str, torch.Tensor]  # name -> tensor([sum, total])


def pair(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """[sum, total] in float64, on the device of the numerator: pooling never waits for the device."""
    numerator = torch.as_tensor(numerator).detach()
    denominator = torch.as_tensor(denominator, device=numerator.device)
    return torch.stack([numerator.to(torch.float64), denominator.to(torch.float64)])


def scalar_counts(values: dict[str, torch.Tensor], weight: torch.Tensor) -> MetricCounts:
    """Per-batch losses, weighted by the supervised positions they average over: pooling batches (or the data-
    parallel ranks' parts of one batch) gives the loss of all their positions together."""
    return {name: pair(value.detach() * weight, weight) for name, value in values.items()}


def path_counts(path: str, correct: torch.Tensor, valid: torch.Tensor, first_slot: int) -> MetricCounts:
    """Accepted length (anchor included) and per-slot conditional acceptance of one path.

    correct, valid: [N, S] over the draft slots first_slot .. B-1. A masked slot ends the run.
    """
    ok = correct & valid
    alive = ok.long().cumprod(dim=-1).bool()
    counted = valid.any(dim=-1)
    lengths = 1.0 + alive.double().sum(-1)
    counts = {f"{path}_accepted_length": pair((lengths * counted).sum(), counted.sum())}
    alive_before = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], dim=1)
    for column in range(correct.shape[1]):
        counts[conditional_acc_name(path, first_slot + column)] = pair(
            alive[:, column].sum(), (alive_before[:, column] & valid[:, column]).sum()
        )
    return counts


@torch.no_grad()
def unary_counts(stats: RowStatistics, mask: torch.Tensor, block_size: int, first_slot: int) -> MetricCounts:
    """Unary and candidate metrics, plus the unary and oracle paths.

    stats: the unary head's per-row statistics; mask: [M] aligned loss mask.
    """
    valid = mask > 0
    weight = valid.double()
    slots = torch.arange(mask.shape[0], device=mask.device) % block_size
    unary_correct = stats.draft_ids == stats.target_ids
    in_candidates = (stats.candidate_ids == stats.target_ids[:, None]).any(-1)
    candidate_mass = stats.target_candidate_logprobs.exp().sum(-1)

    counts: MetricCounts = {
        UNARY_FULL_ACC: pair((unary_correct * weight).sum(), weight.sum()),
        "accept_rate": pair((stats.overlap * weight).sum(), weight.sum()),
        UNARY_CANDIDATE_RECALL: pair((in_candidates * weight).sum(), weight.sum()),
        UNARY_CANDIDATE_TARGET_MASS: pair((candidate_mass * weight).sum(), weight.sum()),
    }
    for slot in range(first_slot, block_size):
        at_slot = weight * (slots == slot)
        counts[unary_position_acc_name(slot)] = pair((unary_correct * at_slot).sum(), at_slot.sum())
        counts[recall_position_name(slot)] = pair((in_candidates * at_slot).sum(), at_slot.sum())

    blocks = lambda x: draft_slots(x, block_size, first_slot)  # noqa: E731
    block_valid = blocks(valid)
    counted = block_valid.any(-1)
    tv_length = 1.0 + (blocks(stats.overlap.double() * weight)).cumprod(-1).sum(-1)
    counts["accept_len_tv"] = pair((tv_length * counted).sum(), counted.sum())
    counts.update(path_counts("unary", blocks(unary_correct), block_valid, first_slot))
    # A documented difference from speculators 0.9.0: with sample_from_anchor (plain DFlash only) every path
    # here, the oracle's included, starts at slot 0, the first slot the draft predicts; speculators' oracle
    # path starts at slot 1 there. Without sample_from_anchor both start at slot 1.
    counts.update(path_counts("oracle", blocks(in_candidates), block_valid, first_slot))
    return counts


@torch.no_grad()
def selector_counts(
    teacher_forced_scores: torch.Tensor,  # [M, K] over the ORIGINAL candidates, teacher-forced predecessor
    stats: RowStatistics,  # the unary head's per-row statistics
    mask: torch.Tensor,  # [M]
    realized_tokens: torch.Tensor,  # [N, B - first_slot] the greedy selector walk
    injected_target_logprobs: torch.Tensor,  # [M, K] of the training candidates (parity mass only)
    block_size: int,
    first_slot: int,
) -> MetricCounts:
    """Selector metrics and the realized path (the walk replayed for real). The injection never enters them."""
    candidate_ids, target_ids = stats.candidate_ids, stats.target_ids
    weight = (mask > 0).double()
    in_candidates = (candidate_ids == target_ids[:, None]).any(-1)
    chosen = candidate_ids.gather(-1, teacher_forced_scores.argmax(-1, keepdim=True)).squeeze(-1)
    selector_hit = (chosen == target_ids) & in_candidates
    selector_probs = torch.softmax(teacher_forced_scores.float(), dim=-1)
    selector_alpha = torch.minimum(stats.target_candidate_logprobs.exp(), selector_probs).sum(-1)
    injected_mass = injected_target_logprobs.exp().sum(-1)

    blocks = lambda x: draft_slots(x, block_size, first_slot)  # noqa: E731
    counts: MetricCounts = {
        TEACHER_FORCED_SELECTOR_ACC: pair((selector_hit * weight).sum(), (in_candidates * weight).sum()),
        "teacher_forced_selector_hit_rate": pair((selector_hit * weight).sum(), weight.sum()),
        "selector_accept_rate_tf": pair((selector_alpha * weight).sum(), weight.sum()),
        UNARY_CANDIDATE_TARGET_MASS_INJECTED: pair((injected_mass * weight).sum(), weight.sum()),
    }
    counts.update(path_counts("realized", realized_tokens == blocks(target_ids), blocks(mask > 0), first_slot))
    return counts


def pool(into: MetricCounts, counts: MetricCounts) -> MetricCounts:
    """Add counts from another batch or process (sums and totals both add)."""
    for name, pair in counts.items():
        into[name] = into[name] + pair if name in into else pair.clone()
    return into


def finalize(counts: MetricCounts, block_size: int | None = None, first_slot: int = 1) -> dict[str, float]:
    """Divide once: sum / total, 0 where the total is 0. Adds the no-anchor marginal expected accepted length."""
    # One transfer for every pair, wherever the counts were pooled.
    host = torch.stack([pair.to(torch.float64) for pair in counts.values()]).cpu().tolist() if counts else []
    values = {name: (part / total if total > 0 else 0.0) for name, (part, total) in zip(counts, host, strict=True)}
    if block_size is not None and unary_position_acc_name(first_slot) in values:
        product, marginal = 1.0, 0.0
        for slot in range(first_slot, block_size):
            product *= values[unary_position_acc_name(slot)]
            marginal += product
        values["eal_marginal_no_anchor"] = marginal
    return values
