"""The final validation: every anchor of every document, identical for every run, and per-document pairs
that add up to the pooled metrics."""

import pytest
import torch

from algorithms.blocks import PackedRow, eligible_anchor_mask
from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    HEADLINE_METRICS,
    NUM_ANCHORS,
    NUM_DOCUMENTS,
    UNARY_CANDIDATE_TARGET_MASS,
    finalize,
    se_name,
)
from harness.devices import anchors_to
from harness.validation import (
    ANCHORS_COLUMN,
    DOCUMENT_COLUMN,
    document_anchors,
    pairs,
    per_position_rows,
    pooled_counts,
    validate_documents,
)

from conftest import packed_row, tiny_draft

DOC_LENGTHS = (20, 14, 17)


def _documents() -> list[PackedRow]:
    """The one-document rows of a packed row (what FeatureCache.document_rows builds from the cache)."""
    row = packed_row(DOC_LENGTHS, pad=0)
    rows, start = [], 0
    for size in DOC_LENGTHS:
        span = slice(start, start + size)
        rows.append(
            PackedRow(
                *(getattr(row, f)[span] for f in ("input_ids", "loss_mask")),
                torch.zeros(size, dtype=torch.long),
                *(getattr(row, f)[span] for f in ("position_ids", "features", "target_hidden")),
            )
        )
        start += size
    return rows


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_per_document_validation_equals_one_pass_over_the_packed_row(algorithm):
    draft = tiny_draft(algorithm)
    validation = validate_documents(draft, _documents(), "cpu", "fp32")
    row = packed_row(DOC_LENGTHS, pad=0)
    eligible = torch.nonzero(eligible_anchor_mask(row.loss_mask, row.document_ids, 4)).squeeze(-1)
    anchors = type(document_anchors(_documents()[0], 4))(eligible, torch.ones_like(eligible, dtype=torch.bool))
    draft.eval()
    with torch.no_grad():
        packed = draft.training_forward(row, anchors_to(anchors, "cpu")).counts
    for name in ACCEPTED_LENGTHS:
        assert validation.counts[name].tolist() == pytest.approx(packed[name].tolist(), rel=1e-6)
    assert validation.values[NUM_ANCHORS] == eligible.numel()
    assert validation.values[NUM_DOCUMENTS] == len(DOC_LENGTHS)


def test_every_run_validates_on_the_same_documents_and_anchors():
    runs = [
        validate_documents(tiny_draft("dflash", seed=0), _documents(), "cpu", "fp32"),
        validate_documents(tiny_draft("dflash2", seed=1, conv_kernel_size=3), _documents(), "cpu", "fp32"),
    ]
    first, second = (run.documents[[DOCUMENT_COLUMN, ANCHORS_COLUMN]] for run in runs)
    assert first.equals(second)
    assert first[DOCUMENT_COLUMN].tolist() == [0, 1, 2]
    # Every eligible anchor: a document of L tokens, 3 of them prompt, block 4 -> L - 3 - 3 anchors.
    assert [len(cell.split()) for cell in first[ANCHORS_COLUMN]] == [size - 6 for size in DOC_LENGTHS]
    assert runs[0].values["loss"] != runs[1].values["loss"]  # two different drafts, measured on one anchor set


def test_per_document_pairs_add_up_to_the_pooled_metrics_and_carry_standard_errors():
    draft = tiny_draft("dflash2")
    validation = validate_documents(draft, _documents(), "cpu", "fp32")
    pooled = pooled_counts(validation.documents)
    for name in ACCEPTED_LENGTHS:
        sums, totals = pairs(validation.documents, name)
        assert len(sums) == len(DOC_LENGTHS)
        assert pooled[name].tolist() == pytest.approx(validation.counts[name].tolist())
    recomputed = finalize(pooled, draft.shared.block_size, draft.shared.first_draft_slot)
    for name in HEADLINE_METRICS:
        assert recomputed[name] == pytest.approx(validation.values[name])
        assert validation.values.get(se_name(name), 0.0) >= 0
    assert validation.values[se_name(UNARY_CANDIDATE_TARGET_MASS)] > 0  # an untrained draft accepts no token


def test_a_cap_keeps_evenly_spaced_anchors():
    document = _documents()[0]
    every = document_anchors(document, 4).positions
    capped = document_anchors(document, 4, cap=5).positions
    assert capped.numel() == 5 and capped[0] == every[0] and capped[-1] == every[-1]
    assert set(capped.tolist()) <= set(every.tolist())


def test_per_position_rows_give_counts_and_wilson_intervals():
    validation = validate_documents(tiny_draft("dflash2"), _documents(), "cpu", "fp32")
    rows = per_position_rows(validation.counts)
    assert [r["slot"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["anchors"] > 0
        for path in ("unary", "realized", "oracle"):
            if r[f"{path}_n"]:
                assert r[f"{path}_low"] <= r[f"{path}_conditional_acc"] <= r[f"{path}_high"]
    assert rows[0]["unary_n"] == rows[0]["anchors"]  # slot 1 has no earlier slot to fail
