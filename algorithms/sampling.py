"""Drawing one draft token per row from scores: what every member's proposal walks do at each slot."""

from __future__ import annotations

import torch


def draw(
    scores: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The argmax of scores [..., C] at temperature 0 (first index on ties); otherwise a sample from
    softmax(scores / T), returned with that distribution, which rejection sampling verifies against."""
    if temperature > 0:
        probs = torch.softmax(scores / temperature, dim=-1)
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        return flat.view(probs.shape[:-1]), probs
    return scores.argmax(-1), None
