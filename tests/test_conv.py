import pytest
import torch

from algorithms.conv import GroupedDynamicConv


def scalar_reference(conv: GroupedDynamicConv, sequence, delta, side, block_len):
    """The conv formula, one scalar at a time."""
    length, hidden = sequence.shape
    out = torch.zeros(length, hidden, dtype=torch.float64)
    for t in range(length):
        slot = t % block_len
        for c in range(hidden):
            for tau in range(conv.kernel_size):
                if slot >= tau:
                    coef = conv.base_kernel[side, tau, c].double() + delta[t, side, tau, c // conv.group_size].double()
                    out[t, c] += coef * sequence[t - tau, c].double()
    return out


@pytest.mark.parametrize("kernel_size", [1, 2, 3, 4])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_vectorised_conv_equals_scalar_loop(kernel_size, group_size):
    torch.manual_seed(kernel_size * 10 + group_size)
    conv = GroupedDynamicConv(8, kernel_size, group_size)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    sequence = torch.randn(12, 8)  # 3 blocks of 4
    delta = conv.dynamic_taps(torch.randn(12, 8))
    for side in (0, 1):
        got = conv(sequence, delta, side, block_len=4)
        assert torch.allclose(got.double(), scalar_reference(conv, sequence, delta, side, 4), atol=1e-5)


def test_identity_at_init():
    conv = GroupedDynamicConv(16, 3, 4)
    sequence = torch.randn(8, 16)
    delta = conv.dynamic_taps(torch.randn(8, 16))
    assert torch.equal(conv(sequence, delta, 0, 4), sequence)
    assert torch.equal(conv(sequence, delta, 1, 4), sequence)


def test_conv_never_crosses_a_block():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(8, 4, 2)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    sequence = torch.randn(12, 8)
    delta = conv.dynamic_taps(torch.randn(12, 8))
    before = conv(sequence, delta, 0, 4)
    perturbed = sequence.clone()
    perturbed[7] += 5.0  # last slot of block 1
    after = conv(perturbed, delta, 0, 4)
    assert torch.equal(after[8:], before[8:]), "block 2 must not read block 1"
    assert torch.equal(after[:4], before[:4])
    assert not torch.equal(after[7], before[7])


def test_gradients_reach_both_conv_tensors_at_init():
    conv = GroupedDynamicConv(8, 2, 4)
    normed = torch.randn(8, 8)
    delta = conv.dynamic_taps(normed)
    conv(conv(torch.randn(8, 8), delta, 0, 4), delta, 1, 4).pow(2).sum().backward()
    assert conv.base_kernel.grad.abs().sum() > 0
    assert conv.kernel_projection.weight.grad.abs().sum() > 0


def test_conv_gradients_equal_autograd_of_the_formula():
    """The hand-written backward against double-precision gradcheck of the same function."""
    from algorithms.conv import _BlockConv

    torch.manual_seed(0)
    blocks = torch.randn(3, 4, 2, 3, dtype=torch.float64, requires_grad=True)  # N, L, G, g
    base = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)  # K = 3 taps
    taps = torch.randn(3, 4, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_BlockConv.apply, (blocks, base, taps))
