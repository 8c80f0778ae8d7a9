"""Verification rules of speculative decoding: greedy prefix matching and lossless rejection sampling."""

import math

import pytest
import torch

from algorithms.dflash import Proposal
from algorithms.selector import CandidateSelector
from harness.decode import verify_greedy, verify_sampled

VOCAB, DRAWS = 12, 20000
# chi-square critical value for df = 11 at alpha = 0.001 (threshold for every test below)
CHI2_CRITICAL_DF11_P001 = 31.26


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 7, 1, 9]):
        logits[row, token] = 5.0
    full = verify_greedy(logits, torch.tensor([3, 7, 1]))
    assert (full.accepted, full.bonus) == (3, 9)
    partial = verify_greedy(logits, torch.tensor([3, 2, 1]))
    assert (partial.accepted, partial.bonus) == (1, 7)
    none = verify_greedy(logits, torch.tensor([4, 7, 1]))
    assert (none.accepted, none.bonus) == (0, 3)


def _target(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(3, VOCAB, generator=generator) * 1.5, -1)


def test_dflash_rejection_sampling_is_lossless():
    target = _target(0)
    generator = torch.Generator().manual_seed(1)
    draft = torch.softmax(torch.randn(2, VOCAB, generator=generator) * 2, -1)
    first = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        tokens = torch.multinomial(draft, 1, generator=generator).squeeze(-1)
        verdict = verify_sampled(target, Proposal(tokens, draft, None), generator)
        first[int(tokens[0]) if verdict.accepted >= 1 else verdict.bonus] += 1
    assert chi_square(first, target[0]) < CHI2_CRITICAL_DF11_P001


def _selector_walks(unary_scale: float):
    """DRAWS sampled selector walks over 2 slots with K=4 of 12 candidates, from one fixed block."""
    torch.manual_seed(0)
    selector = CandidateSelector(VOCAB, 8, 4, init="normal")
    with torch.no_grad():
        selector.successor_codebook.normal_(std=2.0)
        selector.predecessor_codebook.normal_(std=2.0)
    generator = torch.Generator().manual_seed(4)
    unary = torch.randn(1, 2, VOCAB, generator=generator) * unary_scale
    candidate_unary, candidate_ids = unary.topk(4, dim=-1)
    hidden = torch.randn(1, 2, 8, generator=generator)
    with torch.no_grad():
        walks = selector.walk(
            candidate_unary.expand(DRAWS, -1, -1),
            candidate_ids.expand(DRAWS, -1, -1),
            hidden.expand(DRAWS, -1, -1),
            torch.full((DRAWS,), 5),
            temperature=1.0,
            generator=generator,
        )
    return walks, unary, generator


def test_dflash2_rejection_sampling_with_realized_selector_rows_is_lossless():
    """q comes from the selector walk over K candidates, conditioned on the sampled predecessor."""
    walks, _, generator = _selector_walks(1.0)
    target = _target(3)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for n in range(DRAWS):
        proposal = Proposal(walks.tokens[n], walks.probs[n], walks.candidate_ids[n])
        verdict = verify_sampled(target, proposal, generator)
        first[int(walks.tokens[n, 0]) if verdict.accepted >= 1 else verdict.bonus] += 1
        if verdict.accepted >= 1:  # the second emitted token, given the first draft was accepted
            second[int(walks.tokens[n, 1]) if verdict.accepted >= 2 else verdict.bonus] += 1
    # only 4 of 12 tokens can be drafted: the residual must supply the rest of the target mass
    assert chi_square(first, target[0]) < CHI2_CRITICAL_DF11_P001
    assert second.sum() > 2000 and chi_square(second, target[1]) < CHI2_CRITICAL_DF11_P001


def test_domino_rejection_sampling_with_walked_rows_is_lossless():
    """q of each slot is Domino's corrected distribution given the tokens drawn before it in the block."""
    from algorithms import build_draft

    from conftest import HIDDEN, tiny_config, tiny_target

    torch.manual_seed(0)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    config = tiny_config("domino", block_size=3, domino_pure_prefix=0)
    draft = build_draft(config, tiny_target(vocab_size=VOCAB), embed, head)
    with torch.no_grad():
        # a delta that depends strongly on the drawn tokens
        for weight, std in ((draft.embed_proj[2].weight, 3.0), (draft.embed_proj[0].weight, 1.0)):
            weight.normal_(std=std)
        draft.prefix_gru.weight_ih_l0.normal_(std=1.0)
        generator = torch.Generator().manual_seed(4)
        hidden = torch.randn(1, 2, HIDDEN, generator=generator).expand(DRAWS, -1, -1)
        base = torch.randn(1, 2, VOCAB, generator=generator).expand(DRAWS, -1, -1)
        tokens, probs = draft.walk(base, hidden, torch.full((DRAWS,), 5), 1.0, generator)
    assert float((probs[:, 1] - probs[0, 1]).abs().max()) > 0.5, "slot 2's q depends on slot 1's draw"
    target = _target(3)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for n in range(DRAWS):
        verdict = verify_sampled(target, Proposal(tokens[n], probs[n], None), generator)
        first[int(tokens[n, 0]) if verdict.accepted >= 1 else verdict.bonus] += 1
        if verdict.accepted >= 1:
            second[int(tokens[n, 1]) if verdict.accepted >= 2 else verdict.bonus] += 1
    assert chi_square(first, target[0]) < CHI2_CRITICAL_DF11_P001
    assert second.sum() > 2000 and chi_square(second, target[1]) < CHI2_CRITICAL_DF11_P001


def test_dspark_rejection_sampling_with_walked_rows_and_scheduled_cuts_is_lossless():
    """q of each slot is DSpark's Markov-corrected distribution given the token drawn before it, and the
    confidence head cuts the block where its running product falls below 1/2 (a cut that depends on the
    draws): the emitted tokens still follow the target."""
    from algorithms import build_draft

    from conftest import HIDDEN, tiny_config, tiny_target

    torch.manual_seed(0)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    draft = build_draft(tiny_config("dspark", block_size=3), tiny_target(vocab_size=VOCAB), embed, head)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_(std=1.0)
        draft.markov_head.markov_w2.weight.normal_(std=3.0)  # a bias that depends strongly on the drawn token
        # slot 1's confidence is fixed (its previous token is the anchor), slot 2's follows slot 1's draw
        draft.confidence_head.proj.weight.normal_(std=0.3)
        draft.confidence_head.proj.weight[:, HIDDEN:].normal_(std=1.5)
        draft.confidence_head.proj.bias.fill_(2.0)
        generator = torch.Generator().manual_seed(4)
        hidden = torch.randn(1, 2, HIDDEN, generator=generator).expand(DRAWS, -1, -1)
        base = torch.randn(1, 2, VOCAB, generator=generator).expand(DRAWS, -1, -1)
        tokens, probs, confidence = draft.walk(base, hidden, torch.full((DRAWS,), 5), 1.0, generator)
    assert float((probs[:, 1] - probs[0, 1]).abs().max()) > 0.5, "slot 2's q depends on slot 1's draw"
    proposals = [Proposal(tokens[n], probs[n], None, confidence[n]).scheduled(0.5) for n in range(DRAWS)]
    kept = torch.tensor([len(p.tokens) for p in proposals])
    assert set(kept.tolist()) == {1, 2} and 0.2 < float((kept == 1).float().mean()) < 0.8, "cuts vary with draws"
    target = _target(3)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for proposal in proposals:
        verdict = verify_sampled(target, proposal, generator)
        first[int(proposal.tokens[0]) if verdict.accepted >= 1 else verdict.bonus] += 1
        if verdict.accepted >= 1:
            second[int(proposal.tokens[1]) if verdict.accepted >= 2 else verdict.bonus] += 1
    assert chi_square(first, target[0]) < CHI2_CRITICAL_DF11_P001
    assert second.sum() > 2000 and chi_square(second, target[1]) < CHI2_CRITICAL_DF11_P001


def test_unary_softmax_as_q_would_not_be_lossless():
    """The test has teeth: verifying DFlash2 drafts against the unary softmax breaks the distribution."""
    walks, unary, generator = _selector_walks(3.0)
    target = _target(3)
    wrong_q = torch.softmax(unary[0], -1)
    first = torch.zeros(VOCAB)
    for n in range(DRAWS):
        verdict = verify_sampled(target, Proposal(walks.tokens[n], wrong_q, None), generator)
        first[int(walks.tokens[n, 0]) if verdict.accepted >= 1 else verdict.bonus] += 1
    assert chi_square(first, target[0]) > CHI2_CRITICAL_DF11_P001


def test_requests_without_a_cycle_are_excluded_from_the_per_request_mean_and_counted():
    from harness.decode import DecodeStats
    from harness.evaluate import summarize

    def stats(lengths):
        slots = [len(lengths)] * 3
        return DecodeStats(
            tokens=[1] * max(1, sum(lengths)),
            acceptance_lengths=lengths,
            verified_tokens=[4] * len(lengths),  # anchor + 3 drafts every cycle
            slot_attempts=slots,
            slot_accepts=slots,
            draft_seconds=0.1,
            verify_seconds=0.2,
            total_seconds=0.5,
        )

    runs = [stats([2, 4]), stats([3]), stats([])]  # the last one hit a stop token before any cycle
    metrics = summarize(runs, "m")
    assert metrics["m"] == pytest.approx((3.0 + 3.0) / 2)  # not (3 + 3 + 0) / 3
    assert metrics["m_pooled"] == pytest.approx(9 / 3)
    assert metrics["m_requests_without_cycles"] == 1
    assert metrics["m_accepted_per_verified"] == pytest.approx(9 / 12)  # 9 committed over 3 cycles x 4 verified
    assert math.isnan(stats([]).mean_acceptance_length)
