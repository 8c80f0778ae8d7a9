"""Where tensors live and how they are computed: moving inputs to the model's device, autocast."""

from __future__ import annotations

import torch

from algorithms.blocks import Anchors


def anchors_to(anchors: Anchors, device: torch.device | str) -> Anchors:
    return Anchors(anchors.positions.to(device), anchors.valid.to(device))


def autocast(device: str, precision: str):
    """bf16 autocast with fp32 master weights, or fp32; `auto` is bf16 on CUDA and fp32 on CPU.

    bf16 on CPU is about 2x faster where the CPU has native bf16 (AVX512-BF16/AMX), much slower elsewhere.
    """
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)
