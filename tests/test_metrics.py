from dataclasses import replace

import pytest
import torch

from algorithms.metrics import finalize, path_counts, pool, unary_counts
from algorithms.unary_head import row_statistics


def _logprobs(ids, vocab=10, sharp=20.0):
    return (torch.nn.functional.one_hot(torch.tensor(ids), vocab).float() * sharp).log_softmax(-1)


def _stats(draft_ids, target_ids, candidates):
    """Row statistics of sharp one-hot draft/target rows, with hand-chosen candidate lists."""
    draft, target = _logprobs(draft_ids), _logprobs(target_ids)
    stats = row_statistics(draft, draft.exp(), target, target.exp(), candidates.shape[-1])
    return replace(stats, candidate_ids=candidates, target_candidate_logprobs=target.gather(-1, candidates))


def test_perfect_draft_block_two_gives_two():
    targets = [0, 3, 0, 7]  # two blocks of B=2; slot 0 is the anchor
    mask = torch.tensor([0.0, 1, 0, 1])
    candidates = torch.tensor([[t, 1] if t != 1 else [1, 2] for t in targets])
    values = finalize(unary_counts(_stats(targets, targets, candidates), mask, 2, 1))
    assert values["unary_accepted_length"] == 2.0
    assert values["oracle_accepted_length"] == 2.0
    assert values["accept_len_tv"] == pytest.approx(2.0, abs=1e-6)


def test_first_error_at_slot_three_gives_three():
    correct = torch.tensor([[True, True, False, True, True, True, True]])
    values = finalize(path_counts("unary", correct, torch.ones_like(correct), 1))
    assert values["unary_accepted_length"] == 3.0
    assert values["unary_position_3_conditional_acc"] == 0.0
    assert values["unary_position_2_conditional_acc"] == 1.0


def test_target_outside_top_k_stops_oracle():
    targets = [0, 4, 5, 6]  # one block, B=4
    draft = [0, 4, 9, 6]
    candidates = torch.tensor([[0, 1], [4, 1], [9, 8], [6, 1]])  # slot 2 misses target 5
    values = finalize(unary_counts(_stats(draft, targets, candidates), torch.tensor([0.0, 1, 1, 1]), 4, 1))
    assert values["oracle_accepted_length"] == 2.0
    assert values["unary_accepted_length"] == 2.0
    assert values["unary_candidate_recall"] == pytest.approx(2 / 3)


def test_masked_slot_ends_the_run_and_all_masked_gives_zero():
    correct = torch.ones(2, 3, dtype=torch.bool)
    valid = torch.tensor([[True, False, True], [False, False, False]])
    values = finalize(path_counts("oracle", correct, valid, 1))
    assert values["oracle_accepted_length"] == 2.0  # the second block is not counted
    empty = finalize(path_counts("oracle", correct, torch.zeros_like(valid), 1))
    assert empty["oracle_accepted_length"] == 0.0


def test_pooling_divides_once():
    batch_a = path_counts("unary", torch.ones(10, 4, dtype=torch.bool), torch.ones(10, 4, dtype=torch.bool), 1)
    batch_b = path_counts("unary", torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool), 1)
    assert finalize(pool(pool({}, batch_a), batch_b))["unary_accepted_length"] == pytest.approx(51 / 11)


def test_table_one_arithmetic():
    """Blocks whose pooled conditional recalls are the blog's Table 1 give tau = 4.27 and 6.80."""
    for recalls, tau in (
        ([0.854, 0.803, 0.794, 0.783, 0.775, 0.759, 0.729], 4.27),
        ([0.995, 0.973, 0.948, 0.926, 0.908, 0.894, 0.878], 6.80),
    ):
        blocks = 100000
        alive_counts, product = [], 1.0
        for r in recalls:
            product *= r
            alive_counts.append(round(blocks * product))
        correct = torch.zeros(blocks, 7, dtype=torch.bool)
        for slot, alive in enumerate(alive_counts):
            correct[:alive, slot] = True
        values = finalize(path_counts("oracle", correct, torch.ones_like(correct), 1))
        assert values["oracle_accepted_length"] == pytest.approx(tau, abs=0.006)
        for slot, r in enumerate(recalls, start=1):
            assert values[f"oracle_position_{slot}_conditional_acc"] == pytest.approx(r, abs=1e-3)


def test_with_sample_from_anchor_the_oracle_path_starts_at_slot_0():
    """The documented difference from speculators (whose oracle starts at slot 1): ours scores slot 0 too."""
    from algorithms.metrics import finalize

    from conftest import anchors_for, packed_row, tiny_draft

    draft = tiny_draft("dflash", sample_from_anchor=True, loss="kl_div", position_weighting="fixed-exp-decay")
    row = packed_row()
    values = finalize(draft.training_forward(row, anchors_for(row)).counts)
    assert "oracle_position_0_conditional_acc" in values and "unary_position_0_conditional_acc" in values
    without = tiny_draft("dflash", loss="kl_div", position_weighting="fixed-exp-decay")
    assert "oracle_position_0_conditional_acc" not in finalize(without.training_forward(row, anchors_for(row)).counts)


def test_an_unsupervised_slot_ends_the_path_as_the_turns_end_ends_decoding():
    """A block that reaches past an assistant turn: slots 1-2 are the turn's last tokens, slot 3 the token after
    it, slot 4 the next turn. Decoding stops at the turn's end, so a cycle there accepts at most the turn's two
    remaining tokens: the path stops at the unsupervised slot (1 + 2), even though every prediction is right.
    Skipping the slot and going on, as NeMo AutoModel does, would count 1 + 3."""
    correct = torch.ones(1, 4, dtype=torch.bool)
    supervised = torch.tensor([[True, True, False, True]])
    values = finalize(path_counts("realized", correct, supervised, 1))
    assert values["realized_accepted_length"] == 3.0
