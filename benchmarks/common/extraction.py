"""What the CPU can do beside what feature extraction does: a plain matmul's rate and the cache step's own rate,
shared by the benchmarks that put one against the other."""

from __future__ import annotations

import time

import torch

from harness.data import Document
from harness.features import DEVICE_PRECISION, batch_features, final_dtype


def matmul_rate(dtype: torch.dtype, tokens: int, hidden: int, inner: int, repeats: int = 5) -> float:
    """FLOP/s of a (tokens x hidden) @ (hidden x inner) matmul, the decoder's MLP shape, best of `repeats`."""
    a, b = torch.randn(tokens, hidden, dtype=dtype), torch.randn(hidden, inner, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * tokens * hidden * inner / best


@torch.no_grad()
def extracted(
    target, documents: list[Document], layer_ids: list[int], precision: str = DEVICE_PRECISION, batch_size: int = 8
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """The cache step's (features, final) of each document, computed under `precision` (a FEATURE_PRECISIONS; by
    default as the cache computes them), and its rate in tokens/s."""
    tokens = sum(len(d.input_ids) for d in documents)
    found = []
    started = time.perf_counter()
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        found += batch_features(target, batch, layer_ids, final_dtype(target.dtype), precision)
    return found, tokens / (time.perf_counter() - started)
