"""The chunked unary head against a dense full-vocabulary autograd reference."""

import pytest
import torch

from algorithms import losses
from algorithms import unary_head as head_module
from algorithms.unary_head import UnaryObjective, unary_head

VOCAB, HIDDEN, BLOCK, BLOCKS, TOP_K = 97, 16, 4, 6, 5


def _transform(logits):
    """A verifier transform with both a multiplier and a softcap, so its derivative matters."""
    return 3.0 * torch.tanh(logits * 0.8 / 3.0)


def _case(seed=0, sample_from_anchor=False):
    generator = torch.Generator().manual_seed(seed)
    rows = BLOCKS * BLOCK
    hidden = torch.randn(rows, HIDDEN, generator=generator, dtype=torch.float64).float()
    target_hidden = torch.randn(30, HIDDEN, generator=generator)
    target_rows = torch.randint(0, 30, (rows,), generator=generator)
    target_rows[1::2] = target_rows[0::2]  # shared targets, as overlapping blocks have
    mask = (torch.rand(rows, generator=generator) > 0.2).float()
    if not sample_from_anchor:
        mask.view(BLOCKS, BLOCK)[:, 0] = 0
    mask.view(BLOCKS, BLOCK)[2] = 0  # a padding block
    head_weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    return hidden, target_hidden, target_rows, mask, head_weight


def _reference(hidden, target_hidden, target_rows, mask, head_weight, objective):
    """Dense: full [M, V] logits, per-position losses, weights and the weighted reduction, by autograd."""
    draft_logits = _transform(hidden @ head_weight.T)
    draft_logprobs = draft_logits.log_softmax(-1)
    target_logprobs = _transform(target_hidden[target_rows] @ head_weight.T).log_softmax(-1)
    total = 0.0
    for name, weight in objective.loss_weights.items():
        per_position = losses.PER_POSITION_LOSSES[name](draft_logprobs, target_logprobs) * (mask > 0)
        total = total + weight * losses.reduce_weighted(
            per_position, objective.weights(per_position.detach(), mask), mask
        )
    return total, draft_logits, target_logprobs


@pytest.mark.parametrize("chunk_elements", [10**9, 2 * BLOCK * VOCAB])
@pytest.mark.parametrize(
    "loss_weights, weighting, sample_from_anchor",
    [
        ({"kl_div": 1.0}, "fixed-exp-decay", False),
        ({"ce": 1.0}, "dpace", False),
        ({"kl_div": 1.0, "tv": 0.5}, "dpace", False),
        ({"jsd": 1.0, "rkl": 0.3, "nla": 0.2, "lk_hybrid": 0.7}, "fixed-exp-decay", True),
    ],
)
def test_loss_gradient_and_statistics_equal_dense_reference(
    monkeypatch, chunk_elements, loss_weights, weighting, sample_from_anchor
):
    monkeypatch.setattr(head_module, "CHUNK_ELEMENTS", chunk_elements)  # small: several chunks of whole blocks
    hidden, target_hidden, target_rows, mask, head_weight = _case(sample_from_anchor=sample_from_anchor)
    objective = UnaryObjective(
        loss_weights,
        weighting,
        decay_gamma=4.0,
        dpace_alpha=0.5,
        sample_from_anchor=sample_from_anchor,
        block_size=BLOCK,
        top_k=TOP_K,
    )
    candidate_grad = torch.randn(hidden.shape[0], TOP_K)
    target_token_grad = torch.randn(hidden.shape[0])

    ours_hidden = hidden.clone().requires_grad_(True)
    head = unary_head(ours_hidden, target_hidden, target_rows, mask, head_weight, _transform, objective)
    valid = mask > 0
    (
        head.loss
        + (head.stats.candidate_logits * candidate_grad * valid[:, None]).sum()
        + (head.stats.target_token_logits * target_token_grad * valid).sum()
    ).backward()

    reference_hidden = hidden.clone().requires_grad_(True)
    loss, draft_logits, target_logprobs = _reference(
        reference_hidden, target_hidden, target_rows, mask, head_weight, objective
    )
    candidate_logits, candidate_ids = draft_logits.topk(TOP_K, dim=-1)
    target_ids = target_logprobs.argmax(-1)
    (
        loss
        + (candidate_logits * candidate_grad * valid[:, None]).sum()
        + (draft_logits.gather(-1, target_ids[:, None]).squeeze(-1) * target_token_grad * valid).sum()
    ).backward()

    assert float(head.loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert torch.allclose(ours_hidden.grad, reference_hidden.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(head.stats.candidate_ids[valid], candidate_ids[valid])
    assert torch.equal(head.stats.target_ids[valid], target_ids[valid])
    assert torch.allclose(head.stats.target_candidate_logprobs[valid], target_logprobs.gather(-1, candidate_ids)[valid])
    assert torch.allclose(
        head.stats.overlap[valid], losses.overlap(draft_logits.log_softmax(-1), target_logprobs)[valid]
    )
    assert (head.stats.candidate_logits[~valid] == 0).all()  # unsupervised rows never reach the head


def test_no_gradient_work_under_no_grad():
    hidden, target_hidden, target_rows, mask, head_weight = _case()
    objective = UnaryObjective({"kl_div": 1.0}, "fixed-exp-decay", 4.0, 0.5, False, BLOCK, TOP_K)
    with torch.no_grad():
        head = unary_head(
            hidden.requires_grad_(True), target_hidden, target_rows, mask, head_weight, _transform, objective
        )
    assert not head.loss.requires_grad and not head.stats.candidate_logits.requires_grad


def test_bf16_autocast_head_gradient_within_two_percent_of_fp64():
    """Gradients with bf16 logits stay within 2% of an fp64 reference."""
    hidden, target_hidden, target_rows, mask, head_weight = _case(seed=3)
    objective = UnaryObjective({"kl_div": 1.0}, "fixed-exp-decay", 4.0, 0.5, False, BLOCK, TOP_K)
    ours_hidden = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = unary_head(ours_hidden, target_hidden, target_rows, mask, head_weight, _transform, objective)
    head.loss.backward()
    reference_hidden = hidden.double().requires_grad_(True)
    loss, _, _ = _reference(
        reference_hidden, target_hidden.double(), target_rows, mask.double(), head_weight.double(), objective
    )
    loss.backward()
    relative = (ours_hidden.grad.double() - reference_hidden.grad).norm() / reference_hidden.grad.norm()
    assert float(relative) < 0.02
    assert float(head.loss.detach()) == pytest.approx(float(loss.detach()), rel=0.02)
