"""The family against NeMo AutoModel 0.7.0's own modules where supervision has edges: a turn that ends inside a
block, a gap inside a block, a block whose shifted label runs past the row, packed documents, a row with one
supervised slot. Anchors are pinned (NeMo's sampler would not draw some of them); the existing parity tests use
anchors well inside one document and could not see these edges.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from algorithms.blocks import Anchors, PackedRow
from algorithms.metrics import finalize

from conftest import fitted, packed_row, tiny_draft

pytest.importorskip(
    "nemo_automodel.components.speculative.dflash.jetspec_core",
    reason="nemo-automodel==0.7.0 is not installed (.ci/run installs it with --no-deps)",
)

from benchmarks.common.nemo_peers import (
    fixed_nemo_anchors,
    frozen_modules,
    greedy_dataset_row,
    nemo_backbone,
    nemo_dspark,
    nemo_dspark_loss,
    nemo_row_inputs,
)

pytestmark = pytest.mark.peer

BLOCK = 4


def spans_row(doc_lengths: tuple[int, ...], supervised: list[tuple[int, int]], pad: int = 0) -> PackedRow:
    """A packed row whose loss mask is 1 exactly on the given [start, stop) spans."""
    row = packed_row(doc_lengths=doc_lengths, pad=pad)
    row.loss_mask.zero_()
    for start, stop in supervised:
        row.loss_mask[start:stop] = 1
    return row


@dataclass
class Edge:
    row: PackedRow
    anchors: list[int]
    # False where a block has an unsupervised slot followed by a supervised one: NeMo's accepted length skips
    # the unsupervised slot and goes on, ours stops there (docs/metrics.md), so there ours is at most theirs.
    accepted_lengths_agree: bool = True

    @property
    def packed(self) -> bool:
        return bool((self.row.document_ids != self.row.document_ids[0]).any())


EDGES: dict[str, Callable[[], Edge]] = {
    # The assistant turn ends at 17; blocks at 14..17 put the turn's end inside the block.
    "turn ends inside a block": lambda: Edge(spans_row((40,), [(3, 18), (26, 40)]), [5, 14, 15, 16, 17, 26, 30, 33]),
    # Two unsupervised tokens (20, 21) inside the blocks at 17..19.
    "gap inside a block": lambda: Edge(spans_row((40,), [(3, 20), (22, 40)]), [10, 17, 18, 19, 22, 25, 30, 33], False),
    # 20 = T - B: the last eligible anchor, whose shifted last label is past the row.
    "block runs past the row end": lambda: Edge(spans_row((24,), [(3, 24)]), [4, 9, 13, 17, 18, 19, 20]),
    # Two documents and padding: 16 and 30 are each document's last eligible anchor.
    "packed rows": lambda: Edge(spans_row((20, 14), [(3, 20), (23, 34)], pad=6), [5, 12, 15, 16, 23, 25, 29, 30]),
    # Supervised tokens 10 and 11 only: across both anchors exactly one slot carries loss.
    "one supervised slot": lambda: Edge(spans_row((24,), [(10, 12)]), [10, 11]),
}


def anchors_of(edge: Edge) -> Anchors:
    positions = torch.tensor(edge.anchors)
    return Anchors(positions, torch.ones_like(positions, dtype=torch.bool))


def nemo_packing(row: PackedRow) -> dict:
    """NeMo's packing metadata: per-document positions, document lengths (padding as one more), and the real
    tokens that follow each position in its document."""
    docs = row.document_ids
    lengths = [int((docs == d).sum()) for d in docs.unique() if d >= 0]
    pad = row.length - sum(lengths)
    remaining = torch.zeros(row.length, dtype=torch.long)
    start = 0
    for size in lengths:
        remaining[start : start + size] = torch.arange(size - 1, -1, -1)
        start += size
    return dict(
        position_ids=row.position_ids[None],
        seq_lens=torch.tensor([[*lengths, pad]]),
        doc_remaining=remaining[None],
    )


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


@dataclass
class Sides:
    """One member's step on both sides: loss, gradients and the (teacher-forced) accepted length."""

    loss: tuple[float, float]
    grads: tuple[dict, dict]
    accepted: tuple[float, float]


def ours_step(ours, row, anchors) -> tuple[dict, dict]:
    output = ours.training_forward(row, anchors)
    output.loss.backward()
    return finalize(output.counts), grads(ours)


def dflash_sides(edge: Edge, causal: bool) -> Sides:
    """DFlash (CE on the dataset's greedy tokens, uniform weights) or JetSpec (forward KL, causal blocks)."""
    from nemo_automodel.components.speculative.dflash.core import DFlashTrainerModule
    from nemo_automodel.components.speculative.dflash.jetspec_core import JetSpecTrainerModule

    if causal:
        ours = tiny_draft("jetspec", block_size=BLOCK)
    else:
        ours = tiny_draft("dflash", block_size=BLOCK, loss="ce", position_weighting="uniform")
    head, embed = frozen_modules(ours)
    row, anchors = greedy_dataset_row(edge.row, head), anchors_of(edge)
    fitted(ours, row, anchors)
    common = dict(attention_backend="sdpa", num_anchors=len(edge.anchors))
    if causal:
        theirs = JetSpecTrainerModule(nemo_backbone(ours), head, embed, ours.config.mask_token_id, BLOCK, **common)
        inputs = nemo_row_inputs(row, head)
    else:
        theirs = DFlashTrainerModule(
            nemo_backbone(ours), head, embed, ours.config.mask_token_id, BLOCK, loss_decay_gamma=None, **common
        )
        inputs = nemo_row_inputs(row)
    mine, my_grads = ours_step(ours, row, anchors)
    with fixed_nemo_anchors(anchors):
        their = theirs(**inputs, **(nemo_packing(row) if edge.packed else {}))
    their.loss.backward()
    return Sides(
        (mine["loss"], float(their.loss.detach())),
        (my_grads, grads(theirs.draft_model)),
        (mine["unary_accepted_length"], float(their.accept_len)),
    )


def domino_sides(edge: Edge, shifted: bool, pure_prefix: int) -> Sides:
    from nemo_automodel.components.speculative.dflash.domino_core import DominoTrainerModule

    ours = tiny_draft(
        "domino",
        block_size=BLOCK,
        sample_from_anchor=shifted,
        position_weighting="uniform",
        domino_pure_prefix=pure_prefix,
    )
    head, embed = frozen_modules(ours)
    row, anchors = greedy_dataset_row(edge.row, head), anchors_of(edge)
    ours.set_training_progress(step=3, total_steps=10)  # lambda = 0.4
    fitted(ours, row, anchors)
    domino = dict(projector_type="domino", emb_dim=8, gru_hidden_dim=16, pure_draft_prefix_len=pure_prefix)
    theirs = DominoTrainerModule(
        nemo_backbone(ours, **domino, shift_label=shifted),
        head,
        embed,
        ours.config.mask_token_id,
        BLOCK,
        attention_backend="sdpa",
        num_anchors=len(edge.anchors),
        loss_decay_gamma=None,
        shift_label=shifted,
    )
    mine, my_grads = ours_step(ours, row, anchors)
    with fixed_nemo_anchors(anchors):
        their = theirs(**nemo_row_inputs(row), lambda_base=0.4, **(nemo_packing(row) if edge.packed else {}))
    their.loss.backward()
    return Sides(
        (mine["loss"], float(their.loss.detach())),
        (my_grads, grads(theirs.draft_model)),
        (mine["realized_accepted_length"], float(their.accept_len)),
    )


def dspark_sides(edge: Edge) -> Sides:
    """DSpark's accepted length on NeMo's side is a diagnostic of its loss, not a count: the loss, its terms and
    the gradients are compared; `accepted` repeats ours on both sides."""
    ours = tiny_draft("dspark", block_size=BLOCK, sample_from_anchor=True, position_weighting="uniform")
    head, _ = frozen_modules(ours)
    row, anchors = greedy_dataset_row(edge.row, head), anchors_of(edge)
    fitted(ours, row, anchors)
    theirs = nemo_dspark(ours, num_anchors=len(edge.anchors))
    mine, my_grads = ours_step(ours, row, anchors)
    packing = nemo_packing(row) if edge.packed else {}
    loss, _ = nemo_dspark_loss(theirs, row, anchors, ours.knobs.confidence_loss_weight, **packing)
    loss.backward()
    accepted = mine["realized_accepted_length"]
    return Sides((mine["loss"], float(loss.detach())), (my_grads, grads(theirs)), (accepted, accepted))


# (member, its sides, loss and gradient tolerances: the existing parity tests')
MEMBERS = {
    "dflash": (lambda e: dflash_sides(e, causal=False), 1e-4, 1e-4),
    "jetspec": (lambda e: dflash_sides(e, causal=True), 1e-4, 1e-4),
    "domino shifted": (lambda e: domino_sides(e, shifted=True, pure_prefix=1), 1e-4, 1e-3),
    "domino shifted, no pure prefix": (lambda e: domino_sides(e, shifted=True, pure_prefix=0), 1e-4, 1e-3),
    "domino unshifted": (lambda e: domino_sides(e, shifted=False, pure_prefix=0), 1e-4, 1e-3),
    "domino unshifted, pure prefix": (lambda e: domino_sides(e, shifted=False, pure_prefix=1), 1e-4, 1e-3),
    "dspark": (dspark_sides, 1e-4, 1e-3),
}


@pytest.mark.parametrize("edge_name", list(EDGES))
@pytest.mark.parametrize("member", list(MEMBERS))
def test_edge_rows_match_nemo(member, edge_name):
    sides_of, loss_rel, grad_rel = MEMBERS[member]
    edge = EDGES[edge_name]()
    sides = sides_of(edge)
    ours, theirs = sides.loss
    assert ours > 0 and ours == pytest.approx(theirs, rel=loss_rel)
    my_grads, their_grads = sides.grads
    assert my_grads
    for name, grad in my_grads.items():
        assert torch.allclose(grad, their_grads[name], rtol=grad_rel, atol=1e-6), name
    mine, their_accepted = sides.accepted
    if edge.accepted_lengths_agree:
        assert mine == pytest.approx(their_accepted, rel=1e-5)
    else:
        assert mine <= their_accepted + 1e-6
