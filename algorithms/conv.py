"""Grouped dynamic causal convolution inside anchor blocks (spec §4.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedDynamicConv(nn.Module):
    """Conv_side(e)[t, c] = sum_tau [slot(t) >= tau] (base[side, tau, c] + delta[t, side, tau, c // g]) e[t - tau, c]."""

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
        k, groups = self.kernel_size, self.num_groups
        blocks = sequence.float().view(-1, block_len, hidden)
        # Zero padding before slot 0 of every block is the anchor-block boundary: taps never cross it.
        padded = F.pad(blocks, (0, 0, k - 1, 0))
        windows = padded.unfold(1, k, 1).flip(-1)  # [N, L, H, K]; last dim indexed by tap tau
        windows = windows.reshape(length, groups, self.group_size, k)
        base = self.base_kernel[side].float().T.reshape(groups, self.group_size, k)
        dynamic = delta[:, side].float().transpose(1, 2)[:, :, None, :]  # [M, G, 1, K]
        out = (windows * (base + dynamic)).sum(-1)
        return out.reshape(length, hidden).to(sequence.dtype)
