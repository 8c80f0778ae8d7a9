"""The one way a served speed is timed against the target alone: alone, then with the drafters, then alone again.

A machine that speeds up or slows down while the drafters run moves the baseline with it: each request's speed
alone is the mean of its two alone passes, and every speed-up pairs a request with that mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from harness.serving.server import Completion

Passes = dict[Any, list[Completion]]  # one completion per prompt, grouped (by prompt set, category, ...)
T = TypeVar("T")


@dataclass
class Bracketed(Generic[T]):
    """What the drafters did, between two passes of the target alone over the same prompts."""

    before: Passes
    drafted: T
    after: Passes

    @property
    def alone(self) -> Passes:
        """Each request's first alone completion at the mean of the two passes' tokens/s."""
        return {
            key: [
                replace(b, tokens_per_s=(b.tokens_per_s + a.tokens_per_s) / 2)
                for b, a in zip(group, self.after[key], strict=True)
            ]
            for key, group in self.before.items()
        }

    def alone_speeds(self) -> dict[Any, list[float]]:
        """Each request's bracketed tokens/s alone, by group."""
        return {key: [c.tokens_per_s for c in group] for key, group in self.alone.items()}


def bracketed(alone_pass: Callable[[str], Passes], drafted: Callable[[], T]) -> Bracketed[T]:
    """`alone_pass("before")`, `drafted()`, `alone_pass("after")`, in that order."""
    before = alone_pass("before")
    result = drafted()
    return Bracketed(before, result, alone_pass("after"))


def mean_speed(passes: Passes) -> float:
    """Mean tokens/s over the requests of one pass."""
    speeds = [c.tokens_per_s for group in passes.values() for c in group]
    return sum(speeds) / len(speeds)
