"""Grouped dynamic causal convolution inside anchor blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedDynamicConv(nn.Module):
    """Conv_side(e)[t, c] = sum_tau [slot(t) >= tau] (base[side, tau, c] + delta[t, side, tau, c // g]) e[t - tau, c].

    The taps never reach across a block boundary: slot 0 sees only itself.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity init: tap 0 = 1, every other tap and the projection = 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def dynamic_taps(self, normed_input: torch.Tensor) -> torch.Tensor:
        """Delta [M, 2, K, G], laid out side-major from the normed sublayer input."""
        return self.kernel_projection(normed_input).view(-1, 2, self.kernel_size, self.num_groups)

    def forward(self, sequence: torch.Tensor, delta: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        """Convolve `sequence` [M, H], laid out as consecutive blocks of `block_len` slots."""
        length, hidden = sequence.shape
        groups, group_size = self.num_groups, self.group_size
        blocks = sequence.float().view(-1, block_len, groups, group_size)
        base = self.base_kernel[side].float().view(self.kernel_size, groups, group_size)
        taps = delta[:, side].float().view(-1, block_len, self.kernel_size, groups)
        return _BlockConv.apply(blocks, base, taps).reshape(length, hidden).to(sequence.dtype)


def _shift(blocks: torch.Tensor, tau: int) -> torch.Tensor:
    """Slot t takes slot t - tau of its own block; the zero padding before slot 0 is the block boundary."""
    return blocks if tau == 0 else F.pad(blocks[:, :-tau], (0, 0, 0, 0, tau, 0))


def _tap_weight(base: torch.Tensor, taps: torch.Tensor, tau: int) -> torch.Tensor:
    """base[tau] + delta[..., tau] broadcast over each group's channels: [N, L, G, g]."""
    return base[tau] + taps[:, :, tau, :, None]


class _BlockConv(torch.autograd.Function):
    """out = sum_tau shift_tau(x) * (base[tau] + delta_tau), blocks [N, L, G, g], base [K, G, g], taps [N, L, K, G].

    Saves only its inputs and recomputes the per-tap weights and shifts in backward: autograd would
    keep two [M, H] tensors per tap alive until backward.
    """

    @staticmethod
    def forward(ctx, blocks, base, taps):
        ctx.save_for_backward(blocks, base, taps)
        out = blocks * _tap_weight(base, taps, 0)
        for tau in range(1, base.shape[0]):
            out += _shift(blocks, tau) * _tap_weight(base, taps, tau)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        blocks, base, taps = ctx.saved_tensors
        grad_blocks = grad_out * _tap_weight(base, taps, 0)
        grad_base = torch.empty_like(base)
        grad_taps = torch.empty_like(taps)
        for tau in range(base.shape[0]):
            product = grad_out * _shift(blocks, tau)
            grad_base[tau] = product.sum((0, 1))
            grad_taps[:, :, tau] = product.sum(-1)
            if tau:
                grad_blocks[:, :-tau] += (grad_out * _tap_weight(base, taps, tau))[:, tau:]
        return grad_blocks, grad_base, grad_taps
