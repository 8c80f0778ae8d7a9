"""Validation on fixed anchors: a small subset during training, every anchor of every document at the end.

Both anchor sets depend only on the validation documents and the block size, never on the algorithm, its
knobs or the seed, so every run of a study (whose shared knobs are pinned) is measured on the same anchors
and any two runs can be compared document by document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

from algorithms.blocks import Anchors, PackedRow, eligible_anchor_mask, sample_anchors
from algorithms.dflash import DFlashDraft
from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    HEADLINE_METRICS,
    NUM_ANCHORS,
    NUM_DOCUMENTS,
    PATHS,
    MetricCounts,
    conditional_acc_name,
    finalize,
    pool,
    recall_position_name,
    se_name,
    unary_position_acc_name,
)
from harness import devices
from harness.devices import autocast, to_device
from harness.distributed import SINGLE, Ranks
from harness.uncertainty import ratio_estimate, t_interval, wilson

DOCUMENT_COLUMN, ANCHORS_COLUMN = "document", "anchor_positions"
SUM_SUFFIX, TOTAL_SUFFIX = ":sum", ":total"
SUBSET_ROWS = "subset_rows"  # the rows (clusters) a subset validation's standard errors rest on


@dataclass
class Validation:
    """Finalised metrics (with standard errors on the full set), pooled counts and, on the full set, the
    per-document (sum, total) pairs every interval and paired comparison is computed from."""

    values: dict[str, float]
    counts: MetricCounts
    documents: pd.DataFrame | None = None


def subset_anchors(row: PackedRow, index: int, block_size: int, max_anchors: int) -> Anchors:
    """The intermediate validation's anchors of row `index`: max_anchors drawn with the row index as seed."""
    generator = devices.generator("cpu", index)
    return sample_anchors(row.loss_mask, row.document_ids, block_size, max_anchors, generator)


def document_anchors(row: PackedRow, block_size: int, cap: int = 0) -> Anchors:
    """Every eligible anchor of a one-document row; with `cap` > 0, at most `cap` of them, evenly spaced."""
    eligible = torch.nonzero(eligible_anchor_mask(row.loss_mask, row.document_ids, block_size)).squeeze(-1)
    if 0 < cap < eligible.numel():
        eligible = eligible[torch.linspace(0, eligible.numel() - 1, cap).round().long()]
    return Anchors(eligible, torch.ones_like(eligible, dtype=torch.bool))


def _finalize(draft: DFlashDraft, counts: MetricCounts) -> dict[str, float]:
    values = finalize(counts, draft.shared.block_size, draft.shared.first_draft_slot)
    values[NUM_ANCHORS] = float(counts[ACCEPTED_LENGTHS[0]][1]) if counts else 0.0
    return values


@torch.no_grad()
def subset_counts(
    draft: DFlashDraft, rows: list[PackedRow], device: str, precision: str, ranks: Ranks = SINGLE
) -> tuple[MetricCounts, list[torch.Tensor]]:
    """The subset's pooled counts and each row's accepted-length pairs, left on the device (nothing read)."""
    draft.eval()
    shared, counts, row_pairs = draft.shared, {}, []
    for index in ranks.indices(len(rows)):
        anchors = subset_anchors(rows[index], index, shared.block_size, shared.max_anchors)
        with autocast(device, precision):
            row_counts = draft.training_forward(*to_device(rows[index], anchors, device)).counts
        pool(counts, row_counts)
        row_pairs.append(torch.stack([row_counts[name] for name in ACCEPTED_LENGTHS]))
    draft.train()
    return counts, row_pairs


@torch.no_grad()
def validate_subset(
    draft: DFlashDraft, rows: list[PackedRow], device: str, precision: str, ranks: Ranks = SINGLE
) -> Validation:
    """Pooled metrics on the fixed subset of anchors, for progress, pruning and learning curves, with standard
    errors clustered by row. Under torchrun each rank measures its share of the rows and the counts are summed
    over the ranks."""
    counts, row_pairs = subset_counts(draft, rows, device, precision, ranks)
    if ranks.distributed:
        parts, counts = ranks.gather({name: pair.cpu() for name, pair in counts.items()}), {}
        for part in parts:
            pool(counts, part)
    values = _finalize(draft, counts)
    # Per-row (sum, total) pairs, read once per validation: the subset's standard errors, clustered by row.
    host = [pair for part in ranks.gather([p.cpu() for p in row_pairs]) for pair in part]
    values[SUBSET_ROWS] = float(len(host))
    if len(host) > 1:
        stacked = torch.stack(host).double()
        for column, name in enumerate(ACCEPTED_LENGTHS):
            se = ratio_estimate(stacked[:, column, 0].numpy(), stacked[:, column, 1].numpy()).se
            if math.isfinite(se):
                values[se_name(name)] = se
    return Validation(values, counts)


@torch.no_grad()
def validate_documents(
    draft: DFlashDraft, documents: list[PackedRow], device: str, precision: str, cap: int = 0, ranks: Ranks = SINGLE
) -> Validation:
    """Every anchor of every validation document, one forward per document; metrics with standard errors.
    Under torchrun each rank measures its share of the documents; every rank gets all of their pairs."""
    draft.eval()
    records = []
    for index in ranks.indices(len(documents)):
        row = documents[index]
        anchors = document_anchors(row, draft.shared.block_size, cap)
        record = {DOCUMENT_COLUMN: index, ANCHORS_COLUMN: " ".join(map(str, anchors.positions.tolist()))}
        if anchors.positions.numel():
            with autocast(device, precision):
                document_counts = draft.training_forward(*to_device(row, anchors, device)).counts
            host = torch.stack(list(document_counts.values())).cpu().tolist()  # one read per document
            for name, (part, total) in zip(document_counts, host, strict=True):
                record[name + SUM_SUFFIX], record[name + TOTAL_SUFFIX] = part, total
        records.append(record)
    draft.train()
    records = sorted((r for part in ranks.gather(records) for r in part), key=lambda r: r[DOCUMENT_COLUMN])
    frame = pd.DataFrame(records).fillna(0.0)
    counts = pooled_counts(frame)
    values = _finalize(draft, counts)
    values[NUM_DOCUMENTS] = float(sum(1 for r in records if r[ANCHORS_COLUMN]))
    for name in HEADLINE_METRICS:
        se = ratio_estimate(*pairs(frame, name)).se if name + SUM_SUFFIX in frame else float("nan")
        if math.isfinite(se):  # fewer than two documents with a total: no standard error, nothing logged
            values[se_name(name)] = se
    return Validation(values, counts, frame)


def curve_values(values: dict[str, float]) -> dict[str, float]:
    """The learning-curve point of a subset validation: its accepted lengths and their standard errors."""
    names = [*ACCEPTED_LENGTHS, *map(se_name, ACCEPTED_LENGTHS), SUBSET_ROWS]
    return {name: values[name] for name in names if name in values}


def pairs(documents: pd.DataFrame, name: str) -> tuple[pd.Series, pd.Series]:
    """One metric's per-document (sum, total) columns."""
    return documents[name + SUM_SUFFIX], documents[name + TOTAL_SUFFIX]


def pooled_counts(documents: pd.DataFrame) -> MetricCounts:
    """The pooled (sum, total) pairs a per-document frame adds up to."""
    names = [column.removesuffix(SUM_SUFFIX) for column in documents if column.endswith(SUM_SUFFIX)]
    return {
        name: torch.tensor([float(column.sum()) for column in pairs(documents, name)], dtype=torch.float64)
        for name in names
    }


def per_position_rows(counts: MetricCounts) -> list[dict]:
    """Per draft slot: its anchor count, unary accuracy, recall, and each path's conditional acceptance with
    the number of anchors it rests on and a 95% Wilson interval (a run's per_position.csv, a report's table)."""
    # Every slot has counts of its own, so no slot index reaches the number of counts.
    slots = [slot for slot in range(len(counts)) if unary_position_acc_name(slot) in counts]
    rows = []
    for slot in slots:
        hits, anchors = counts[unary_position_acc_name(slot)].tolist()
        row = {
            "slot": slot,
            "anchors": int(anchors),
            "unary_acc": hits / anchors if anchors else float("nan"),
            "recall": float(counts[recall_position_name(slot)][0]) / anchors if anchors else float("nan"),
        }
        for path in PATHS:
            accepted, total = counts[conditional_acc_name(path, slot)].tolist()
            low, high = wilson(accepted, total)
            row |= {
                f"{path}_conditional_acc": accepted / total if total else float("nan"),
                f"{path}_n": int(total),
                f"{path}_low": low,
                f"{path}_high": high,
            }
        rows.append(row)
    return rows


def summary_line(values: dict[str, float]) -> str:
    """`unary 1.39 [1.33, 1.45] | realized 1.56 [1.48, 1.64] | oracle 2.57 [2.41, 2.73]`: a run's description."""
    documents = int(values.get(NUM_DOCUMENTS, 0))
    parts = []
    for name in ACCEPTED_LENGTHS:
        estimate = t_interval(values[name], values.get(se_name(name), float("nan")), documents)
        parts.append(f"{name.removesuffix('_accepted_length')} {estimate.text()}")
    return " | ".join(parts)
