import pytest
import torch

from algorithms.dflash2 import DFlash2Draft, inject_target, replace_weakest
from algorithms.selector import CandidateSelector

from conftest import anchors_for, tiny_draft


def test_teacher_predecessors_example():
    assert DFlash2Draft.teacher_predecessors(None, torch.tensor([[2, 3, 4, 5]])).tolist() == [2, 2, 3, 4]


def test_injection_example():
    candidates = torch.tensor([[5, 9, 2, 7], [5, 9, 2, 7]])
    injected, labels, present = inject_target(candidates, torch.tensor([3, 9]))
    assert injected.tolist() == [[5, 9, 2, 3], [5, 9, 2, 7]]
    assert labels.tolist() == [3, 1]
    assert present.tolist() == [False, True]
    values = torch.tensor([[4.0, 3, 2, 1], [4.0, 3, 2, 1]])
    assert replace_weakest(values, torch.tensor([-1.0, -2.0]), present).tolist() == [[4, 3, 2, -1], [4, 3, 2, 1]]


def _selector(seed=0, vocab=40, hidden=8, rank=4):
    torch.manual_seed(seed)
    return CandidateSelector(vocab, hidden, rank, init="normal")


@torch.no_grad()
def test_walk_equals_row_by_row_loop_and_stays_in_candidates():
    selector = _selector()
    blocks, slots, k = 5, 3, 4
    unary = torch.randn(blocks, slots, 40)
    candidate_unary, candidate_ids = unary.topk(k, dim=-1)
    hidden = torch.randn(blocks, slots, 8)
    anchors = torch.randint(0, 40, (blocks,))
    path = selector.walk(candidate_unary, candidate_ids, hidden, anchors)
    for n in range(blocks):
        previous = int(anchors[n])
        for s in range(slots):
            scores = [
                float(unary[n, s, c])
                + float(
                    (
                        selector.predecessor_codebook[previous]
                        * selector.hidden_projection(hidden[n, s]).detach()
                        * selector.successor_codebook[c]
                    ).sum()
                )
                for c in candidate_ids[n, s].tolist()
            ]
            best = int(candidate_ids[n, s, max(range(k), key=lambda i: (scores[i], -i))])
            assert int(path.tokens[n, s]) == best
            assert best in candidate_ids[n, s].tolist()
            previous = best


def test_sampled_walk_records_realized_rows():
    selector = _selector()
    candidate_unary, candidate_ids = torch.randn(3, 2, 40).topk(4, dim=-1)
    path = selector.walk(
        candidate_unary,
        candidate_ids,
        torch.randn(3, 2, 8),
        torch.tensor([1, 2, 3]),
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert path.probs.shape == (3, 2, 4)
    assert torch.allclose(path.probs.sum(-1), torch.ones(3, 2))
    assert all(int(path.tokens[n, s]) in candidate_ids[n, s].tolist() for n in range(3) for s in range(2))


def test_teacher_forced_scoring_equals_walk_while_path_is_correct(row):
    """When the earlier path equals the dataset tokens, the vectorised scores pick the walk's token."""
    draft = tiny_draft("dflash2", selector_init="normal")
    anchors = anchors_for(row)
    out = draft.forward_blocks(row, anchors)
    candidate_ids, candidate_logits = out.head.stats.candidate_ids, out.head.stats.candidate_logits
    predecessors = draft.teacher_predecessors(out.block_tokens)
    teacher = (
        candidate_ids.gather(
            -1,
            draft.candidate_selector.scores(candidate_logits, out.hidden, predecessors, candidate_ids).argmax(
                -1, keepdim=True
            ),
        )
        .squeeze(-1)
        .view(-1, 4)
    )
    walk = draft.candidate_selector.walk(
        candidate_logits.view(-1, 4, 4)[:, 1:],
        candidate_ids.view(-1, 4, 4)[:, 1:],
        out.hidden.view(-1, 4, out.hidden.shape[-1])[:, 1:],
        out.block_tokens[:, 0],
    ).tokens
    tokens = out.block_tokens[:, 1:]
    for n in range(walk.shape[0]):
        assert int(walk[n, 0]) == int(teacher[n, 1])  # slot 1: both condition on the anchor
        for s in range(1, walk.shape[1]):
            if torch.equal(walk[n, :s], tokens[n, :s]):
                assert int(walk[n, s]) == int(teacher[n, s + 1])
    # Force agreement on a whole block: feed the walk's own path as the dataset tokens.
    forced = out.block_tokens.clone()
    forced[:, 1:] = walk
    forced_teacher = (
        candidate_ids.gather(
            -1,
            draft.candidate_selector.scores(
                candidate_logits, out.hidden, draft.teacher_predecessors(forced), candidate_ids
            ).argmax(-1, keepdim=True),
        )
        .squeeze(-1)
        .view(-1, 4)
    )
    assert torch.equal(forced_teacher[:, 1:], walk)


def test_zero_selector_alpha_reproduces_unary_loss_exactly(row):
    anchors = anchors_for(row)
    mean = lambda counts, name: float(counts[name][0] / counts[name][1])  # noqa: E731
    off = tiny_draft("dflash2", selector_loss_alpha=0.0).training_forward(row, anchors)
    assert float(off.loss.detach()) == mean(off.counts, "unary_loss")
    on = tiny_draft("dflash2", selector_loss_alpha=1.0).training_forward(row, anchors)
    assert mean(on.counts, "unary_loss") == mean(off.counts, "unary_loss")
    assert float(on.loss.detach()) == pytest.approx(
        mean(on.counts, "unary_loss") + mean(on.counts, "selector_loss"), rel=1e-6
    )


def test_selector_loss_injects_target_only_when_missing_and_metrics_ignore_it(row):
    draft = tiny_draft("dflash2")
    anchors = anchors_for(row)
    out = draft.forward_blocks(row, anchors)
    target_ids, candidate_ids = out.head.stats.target_ids, out.head.stats.candidate_ids
    injected, labels, present = inject_target(candidate_ids, target_ids)
    assert torch.equal(present, (candidate_ids == target_ids[:, None]).any(-1))
    assert torch.equal(injected[present], candidate_ids[present])
    assert (injected[~present, -1] == target_ids[~present]).all() and (labels[~present] == 3).all()
    assert (injected.gather(-1, labels[:, None]).squeeze(-1) == target_ids).all()
    counts = draft.training_forward(row, anchors).counts
    mask = out.mask > 0
    recall = counts["unary_candidate_recall"]
    assert float(recall[0]) == float((present & mask).sum()) and float(recall[1]) == float(mask.sum())
    assert float(counts["unary_candidate_target_mass"][0]) <= float(counts["unary_candidate_target_mass_injected"][0])
    # oracle stops at targets the original top-K missed, even though training injected them
    assert float(counts["oracle_accepted_length"][0]) < float(counts["oracle_accepted_length"][1]) * 4
