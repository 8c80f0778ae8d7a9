import math

import pytest
import torch

from algorithms import losses


def test_fixed_decay_check_vectors():
    slots = torch.arange(8)
    expected_false = [0, 1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]
    expected_true = [1, 0.6065, 0.3679, 0.2231, 0.1353, 0.0821, 0.0498, 0.0302]
    assert losses.fixed_exp_decay_weights(slots, 4.0, False).tolist() == pytest.approx(expected_false, abs=1e-4)
    assert losses.fixed_exp_decay_weights(slots, 2.0, True).tolist() == pytest.approx(expected_true, abs=1e-4)


def test_uniform_weights_are_one_on_every_predicted_slot():
    slots = torch.arange(4).repeat(2)
    assert losses.uniform_weights(slots, False).tolist() == [0, 1, 1, 1] * 2
    assert losses.uniform_weights(slots, True).tolist() == [1, 1, 1, 1] * 2
    per_position, mask = torch.tensor([9.0, 1, 2, 3, 9, 4, 5, 6]), torch.tensor([0.0, 1, 1, 1, 0, 1, 1, 0])
    weights = losses.position_weights(per_position, mask, slots, 4, "uniform", 4.0, 0.5, False)
    assert float(losses.reduce_weighted(per_position, weights, mask)) == pytest.approx(
        (1 + 2 + 3 + 4 + 5) / 5, rel=1e-5
    )


def test_dpace_worked_examples():
    mask = torch.tensor([0.0, 1, 1, 1])
    ce = torch.tensor([0.0, math.log(2), math.log(2), math.log(2)])  # c = 0.5
    assert losses.dpace_weights(ce, mask, 4, 0.5).tolist() == pytest.approx([0, 1.734375, 0.984375, 0.421875], abs=1e-6)
    assert losses.dpace_weights(torch.zeros(4), mask, 4, 0.5).tolist() == pytest.approx([0, 3, 2, 1])


def _reference(name: str, draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """fp64 loss formulas, written independently of the implementation."""
    q, p = draft.double().softmax(-1), target.double().softmax(-1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    alpha = torch.minimum(p, q).sum(-1)
    if name == "kl_div":
        return kl(p, q)
    if name == "rkl":
        return kl(q, p)
    if name == "jsd":
        mid = (p + q) / 2
        return 0.5 * kl(p, mid) + 0.5 * kl(q, mid)
    if name == "ce":
        return -q.log().gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)
    if name == "tv":
        return 1 - alpha
    if name == "nla":
        return -alpha.clamp(min=1e-5).log()
    lam = torch.exp(-3 * alpha)
    return lam * kl(p, q) + (1 - lam) * (1 - alpha)


@pytest.mark.parametrize("name", sorted(losses.PER_POSITION_LOSSES))
def test_each_loss_matches_fp64_reference(name):
    generator = torch.Generator().manual_seed(1)
    draft, target = torch.randn(6, 50, generator=generator), torch.randn(6, 50, generator=generator) * 2
    value = losses.PER_POSITION_LOSSES[name](draft.log_softmax(-1), target.log_softmax(-1))
    assert value.tolist() == pytest.approx(_reference(name, draft, target).tolist(), rel=1e-4, abs=1e-6)


def test_reduction_uses_unweighted_mask_count():
    per_position = torch.tensor([1.0, 2.0, 3.0, 4.0])
    weights = torch.tensor([0.0, 1.0, 0.5, 0.25])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert float(losses.reduce_weighted(per_position, weights, mask)) == pytest.approx((2.0 + 1.5) / (2 + 1e-5))


def test_all_masked_batch_gives_zero_loss():
    assert float(losses.reduce_weighted(torch.rand(8), torch.ones(8), torch.zeros(8))) == 0.0
