"""The Pareto front of a multi-objective study, defined once: the study runner tags it on the parent run from
the trials' objective values, and the report lists it from the runs MLflow recorded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def pareto_front(points: Sequence[tuple[T, Sequence[float]]], directions: Sequence[str]) -> list[T]:
    """The points no other point beats, in their given order: another beats a point when it is at least as good on
    every objective (`maximize` or `minimize`) and better on one. Points with the same values all stay."""
    sign = [1.0 if direction == "maximize" else -1.0 for direction in directions]

    def beats(one: Sequence[float], other: Sequence[float]) -> bool:
        better = [s * (a - b) for s, a, b in zip(sign, one, other, strict=True)]
        return min(better) >= 0 and max(better) > 0

    return [key for key, values in points if not any(beats(other, values) for _, other in points)]
