import pytest
import torch

from algorithms.blocks import (
    Anchors,
    LabelRule,
    aligned_loss_mask,
    attention_tiles,
    block_attention_mask,
    block_indices,
    eligible_anchor_mask,
    sample_anchors,
    target_indices,
)


def test_block_indices_example():
    assert block_indices(torch.tensor([0, 5, 10]), 3).tolist() == [0, 1, 2, 5, 6, 7, 10, 11, 12]


def _rule(
    anchor: int,
    valid: bool,
    docs: torch.Tensor,
    q_slot: int,
    q_block: int,
    col: int,
    length: int,
    block: int,
    causal: bool,
    window,
):
    """The attention mask rules, written element by element."""
    if col < length:
        d = int(docs[anchor])
        visible = valid and d != -1 and int(docs[col]) == d and col < anchor
        if window is not None:
            visible = visible and col >= anchor - window
        return visible
    other = col - length
    same = other // block == q_block
    return same and (not causal or other % block <= q_slot)


def test_dense_mask_equals_elementwise_rule():
    docs = torch.tensor([0] * 10 + [1] * 6)
    anchors = Anchors(torch.tensor([3, 8, 12]), torch.tensor([True, True, True]))
    for causal in (False, True):
        for window in (None, 4):
            mask = block_attention_mask(anchors, docs, 4, causal, window)
            assert mask.shape == (12, 16 + 12)
            for q in range(12):
                assert mask[q].any(), "every row sees at least itself"
                for col in range(28):
                    expected = _rule(
                        int(anchors.positions[q // 4]), True, docs, q % 4, q // 4, col, 16, 4, causal, window
                    )
                    assert bool(mask[q, col]) == expected, (causal, window, q, col)


def test_padding_anchor_sees_only_its_block():
    docs = torch.tensor([0] * 8)
    anchors = Anchors(torch.tensor([3, 0]), torch.tensor([True, False]))
    mask = block_attention_mask(anchors, docs, 2, False, None)
    assert not mask[2:, :8].any() and mask[2:, 8 + 2 :].all()


def _random_packing(generator: torch.Generator, max_doc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-4 documents of 1..max_doc tokens, then up to 3 padding tokens; a random loss mask on documents."""
    sizes = torch.randint(
        1, max_doc + 1, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator
    ).tolist()
    length = sum(sizes) + int(torch.randint(0, 4, (1,), generator=generator))
    docs = torch.full((length,), -1)
    start = 0
    for doc, size in enumerate(sizes):
        docs[start : start + size] = doc
        start += size
    loss_mask = (torch.rand(length, generator=generator) > 0.3).float() * (docs != -1)
    return docs, loss_mask


def test_no_block_crosses_a_document_over_random_packings():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        block = int(torch.randint(2, 6, (1,), generator=generator))
        docs, loss_mask = _random_packing(generator, max_doc=11)
        length = docs.shape[0]
        eligible = eligible_anchor_mask(loss_mask, docs, block)
        anchors = sample_anchors(loss_mask, docs, block, 6, generator)
        assert int(anchors.valid.sum()) == min(6, int(eligible.sum()))
        real = anchors.positions[anchors.valid]
        assert torch.equal(real, real.sort().values)
        for a in real.tolist():
            assert a + block - 1 < length
            assert bool(loss_mask[a])
            assert (docs[a : a + block] == docs[a]).all() and docs[a] != -1


@pytest.mark.parametrize("causal, window", [(False, None), (True, 5)])
def test_attention_tiles_reassemble_the_dense_mask_over_random_packings(causal, window):
    """Every visible key of the dense mask lies inside its tile's context span or own blocks, and nothing else."""
    generator = torch.Generator().manual_seed(1)
    for trial in range(100):
        block = int(torch.randint(2, 5, (1,), generator=generator))
        docs, loss_mask = _random_packing(generator, max_doc=14)
        length = docs.shape[0]
        anchors = sample_anchors(loss_mask, docs, block, 7, generator)
        dense = block_attention_mask(anchors, docs, block, causal, window)
        rebuilt = torch.zeros_like(dense)
        tiles = attention_tiles(
            anchors, docs, block, causal, window, blocks_per_tile=int(torch.randint(1, 4, (1,), generator=generator))
        )
        covered = 0
        for tile in tiles:
            width = tile.context.stop - tile.context.start
            rebuilt[tile.queries, tile.context] = tile.mask[:, :width]
            rebuilt[tile.queries, length + tile.queries.start : length + tile.queries.stop] = tile.mask[:, width:]
            assert tile.queries.start == covered
            covered = tile.queries.stop
        assert covered == dense.shape[0]
        assert torch.equal(rebuilt, dense), trial


def test_target_gather_equals_full_head_and_shift():
    length, block = 12, 3
    logits = torch.randn(length, 7)
    anchors = torch.tensor([1, 5, 8])
    flat = block_indices(anchors, block)
    # DFlash (slot k supervised by position a+k-1): shift the full logits right by one, then gather.
    shifted = torch.roll(logits, 1, dims=0)[flat]
    assert torch.equal(logits[target_indices(anchors, block, length, False)], shifted)
    # sample_from_anchor: slot k supervised by position a+k.
    assert torch.equal(logits[target_indices(anchors, block, length, True)], logits[flat])


def _label_mask(loss_mask, document_ids, anchors, rule):
    positions = torch.tensor(anchors)
    valid = torch.tensor([a >= 0 for a in anchors])
    blocks = Anchors(positions.clamp(min=0), valid)
    return aligned_loss_mask(torch.tensor(loss_mask).float(), torch.tensor(document_ids), blocks, 4, rule).view(-1, 4)


SUPERVISED = [0, 0, 1, 1, 1, 0, 0, 1, 1, 1]  # a turn at 2..4, a gap at 5..6, the next turn at 7..9
ONE_DOCUMENT = [0] * 10


def test_unshifted_slots_are_gated_by_their_own_token():
    """Slot k of anchor a is trained on token a + k; slot 0 (the anchor) never."""
    mask = _label_mask(SUPERVISED, ONE_DOCUMENT, [2, 3, 6], LabelRule(offset=0, first_slot=1))
    assert mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]]


def test_shifted_slots_are_gated_by_their_label_and_dropped_past_the_row():
    """Slot k is trained on token a + k + 1: at a turn's end the slot after its last token carries no loss, and
    after a gap the slot that predicts the next turn's first token does; a label past the row is dropped."""
    mask = _label_mask(SUPERVISED, ONE_DOCUMENT, [2, 3, 6], LabelRule(offset=1, first_slot=0))
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [1, 1, 1, 0]]


def test_contiguous_supervision_keeps_each_blocks_leading_run():
    mask = _label_mask(SUPERVISED, ONE_DOCUMENT, [2, 3, 6], LabelRule(offset=1, first_slot=0, contiguous=True))
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]


def test_a_shifted_label_in_the_next_document_or_padding_is_dropped_and_a_padding_anchor_has_none():
    documents = [0, 0, 0, 0, 0, 0, 1, 1, 1, -1]
    supervised = [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    mask = _label_mask(supervised, documents, [2, 5, -1], LabelRule(offset=1, first_slot=0))
    assert mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    packed = _label_mask(supervised, documents, [6], LabelRule(offset=1, first_slot=0))
    assert packed.tolist() == [[1, 1, 0, 0]]  # token 9 is padding
