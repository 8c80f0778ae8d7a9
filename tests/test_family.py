"""The family's defining invariants: causal blocks, zero-initialised heads, walks vs teacher forcing, Domino's
lambda schedule, DSpark's confidence targets and its scheduled verification."""

import dataclasses
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from algorithms.dflash import Proposal
from algorithms.domino import domino_lambda
from algorithms.metrics import finalize

from conftest import anchors_for, fitted, packed_row, tiny_draft

BLOCK = 4


def dflash_like(member):
    """DFlash with the member's shared knobs and backbone weights."""
    reference = tiny_draft("dflash", **dataclasses.asdict(member.shared))
    backbone = reference.state_dict().keys()
    reference.load_state_dict({name: value for name, value in member.state_dict().items() if name in backbone})
    return reference


@pytest.mark.parametrize("algorithm", ["jetspec", "dflash"])
def test_causal_in_block_attention_never_reads_a_later_slot(algorithm):
    """Brute force: every slot's state from a block of B slots equals its state from a block cut just after
    it, for causal attention; bidirectional attention (DFlash) does read later slots."""
    draft = tiny_draft(algorithm, block_size=BLOCK).eval()
    row = packed_row(doc_lengths=(30,), pad=0)
    anchor = 12
    context = row.features[:anchor], row.position_ids[:anchor]
    with torch.no_grad():
        whole = draft.single_block_hidden(*context, int(row.input_ids[anchor]), anchor, BLOCK)
        prefixes = [
            draft.single_block_hidden(*context, int(row.input_ids[anchor]), anchor, size)[-1]
            for size in range(1, BLOCK + 1)
        ]
    same = [torch.allclose(whole[slot], prefixes[slot], atol=1e-6) for slot in range(BLOCK)]
    assert same == ([True] * BLOCK if algorithm == "jetspec" else [False] * (BLOCK - 1) + [True])


@pytest.mark.parametrize("algorithm", ["domino", "dspark"])
def test_zero_initialised_heads_equal_dflash(algorithm):
    """A fresh member's corrected logits are its base logits: the same loss, metrics and proposals as DFlash
    with its shared knobs and weights."""
    row = packed_row()
    anchors = anchors_for(row, block_size=BLOCK)
    member = tiny_draft(algorithm, block_size=BLOCK)
    reference = dflash_like(member)
    ours, theirs = member.training_forward(row, anchors), reference.training_forward(row, anchors)
    mine, dflash = finalize(ours.counts), finalize(theirs.counts)
    assert mine["final_loss"] == pytest.approx(dflash["loss"], rel=1e-6)
    for name in ("unary_accepted_length", "realized_accepted_length", "oracle_accepted_length"):
        assert mine[name] == pytest.approx(dflash[name], abs=1e-12), name
    context = row.features[:20], row.position_ids[:20]
    for temperature, seed in ((0.0, 0), (1.0, 3)):
        draws = [
            draft.eval().propose(
                *context, int(row.input_ids[20]), 20, None, temperature, torch.Generator().manual_seed(seed)
            )
            for draft in (member, reference)
        ]
        assert torch.equal(draws[0].tokens, draws[1].tokens)
        if temperature > 0:
            assert torch.allclose(draws[0].probs, draws[1].probs, atol=1e-6)


def teacher_forced_logits(draft, out) -> torch.Tensor:
    """The corrected logits the objective trains, [N, S, V]."""
    base = draft.output_logits(out.hidden)
    if hasattr(draft, "logit_delta"):  # Domino
        return draft.draft_slots(base + draft.logit_delta(out.hidden, out.block_tokens))
    previous = out.block_tokens.roll(draft.first_slot, dims=1).reshape(-1)
    return draft.draft_slots(draft.step(base, out.hidden, previous)[0])


@pytest.mark.parametrize(("algorithm", "sample_from_anchor"), [("domino", True), ("dspark", True), ("dspark", False)])
def test_the_walk_equals_teacher_forcing_when_it_draws_the_datasets_tokens(algorithm, sample_from_anchor):
    """Fed the dataset's tokens in place of its own draws, the decoding walk computes, slot by slot, exactly
    the logits training computes in one teacher-forced pass."""
    overrides = {"domino_pure_prefix": 0} if algorithm == "domino" else {}
    draft = tiny_draft(algorithm, block_size=BLOCK, sample_from_anchor=sample_from_anchor, **overrides)
    row = packed_row()
    anchors = anchors_for(row, block_size=BLOCK)
    draft.set_training_progress(step=10, total_steps=10)  # Domino's lambda 0: its delta trains
    fitted(draft, row, anchors, steps=5)
    with torch.no_grad():
        out = draft.forward_blocks(row, anchors)
        expected = teacher_forced_logits(draft, out)
        first = draft.first_slot
        # Draft slot s predicts the token after block_tokens[s + first - 1 ... ]: the dataset's next token.
        following = torch.cat([out.block_tokens, out.block_tokens[:, -1:]], dim=1)[:, 1 : expected.shape[1] + 1]
        drawn, seen = iter(following.unbind(1)), []

        def dataset_token(logits, temperature, generator):
            seen.append(logits)
            return next(drawn), None

        with mock.patch(f"algorithms.{algorithm}.draw", dataset_token):
            draft.walk(
                draft.draft_slots(draft.output_logits(out.hidden)),
                draft.draft_slots(out.hidden),
                out.block_tokens[:, 0],
            )
    walked = torch.stack(seen, 1)
    assert float((expected - draft.draft_slots(draft.output_logits(out.hidden))).abs().max()) > 1e-3, "heads moved"
    assert first == (0 if sample_from_anchor else 1)
    assert torch.allclose(walked, expected, atol=1e-5)


def test_domino_lambda_falls_linearly_from_one_to_zero_then_stays():
    # decay over 0.5 of 100 steps = 50 steps: 1 - step / 50
    lambdas = [domino_lambda(step, 100, 0.5) for step in (0, 10, 25, 49, 50, 80)]
    assert lambdas == pytest.approx([1.0, 0.8, 0.5, 0.02, 0.0, 0.0], abs=1e-12)
    draft = tiny_draft("domino")
    draft.set_training_progress(step=30, total_steps=100)
    assert draft.base_weight == pytest.approx(0.4)


def test_dspark_confidence_targets_are_each_slots_acceptance_probability():
    """The BCE's targets are sum_v min(p_v, q_v) of the corrected draft and the target at each row (brute
    force per row), and the confidence loss is their masked, decay-weighted BCE."""
    draft = tiny_draft("dspark", block_size=BLOCK)
    row = packed_row()
    anchors = anchors_for(row, block_size=BLOCK)
    fitted(draft, row, anchors, steps=5)
    captured = {}
    real_bce = F.binary_cross_entropy_with_logits

    def spy(logits, targets, reduction):
        captured.update(logits=logits.detach(), targets=targets)
        return real_bce(logits, targets, reduction=reduction)

    with mock.patch("algorithms.dspark.F.binary_cross_entropy_with_logits", spy):
        counts = draft.training_forward(row, anchors).counts
    with torch.no_grad():
        out = draft.forward_blocks(row, anchors)
        previous = out.block_tokens.roll(draft.first_slot, dims=1).reshape(-1)
        corrected = draft.step(draft.output_logits(out.hidden), out.hidden, previous)[0].softmax(-1)
        target = draft.output_logits(out.target_hidden).softmax(-1)
    brute = torch.tensor(
        [
            sum(min(float(p), float(q)) for p, q in zip(a, b, strict=True))
            for a, b in zip(corrected, target, strict=True)
        ]
    )
    assert torch.allclose(captured["targets"], brute, atol=1e-5)
    assert float(brute.min()) > 0.0 and float(brute.max()) <= 1.0
    weights = draft.unary_objective.weights(torch.zeros_like(out.mask), out.mask)
    bce = real_bce(captured["logits"], brute, reduction="none")
    expected = float((weights * out.mask * bce).sum() / (out.mask.sum() + 1e-5))
    assert finalize(counts)["confidence_loss"] == pytest.approx(expected, rel=1e-4)


def test_scheduled_verification_cuts_where_the_cumulative_confidence_falls_below_the_threshold():
    tokens, probs = torch.tensor([4, 5, 6, 7]), torch.rand(4, 9)
    proposal = Proposal(tokens, probs, None, torch.tensor([0.9, 0.8, 0.5, 0.99]))  # cumulative .9 .72 .36 .3564
    assert proposal.scheduled(0.5).tokens.tolist() == [4, 5]
    assert torch.equal(proposal.scheduled(0.5).probs, probs[:2])
    assert proposal.scheduled(0.358).tokens.tolist() == [4, 5, 6]
    assert proposal.scheduled(0.95).tokens.tolist() == []
    assert proposal.scheduled(0.0) is proposal
    assert Proposal(tokens, probs, None).scheduled(0.9) is not None
    assert Proposal(tokens, probs, None).scheduled(0.9).tokens.tolist() == [4, 5, 6, 7], "no confidence head"


def test_a_fitted_dspark_confidence_tracks_its_acceptance():
    """Trained, the confidence head's error against the acceptance it predicts falls below its fresh error."""
    draft = tiny_draft("dspark", block_size=BLOCK)
    row = packed_row()
    anchors = anchors_for(row, block_size=BLOCK)
    fresh = finalize(draft.training_forward(row, anchors).counts)["confidence_abs_error"]
    fitted(draft, row, anchors, steps=40)
    trained = finalize(draft.training_forward(row, anchors).counts)["confidence_abs_error"]
    assert trained < 0.5 * fresh
