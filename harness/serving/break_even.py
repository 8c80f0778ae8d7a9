"""The break-even of a drafter's shape on the serving machine: the accepted length at which it stops costing time.

llama.cpp's `--spec-synth-len L` runs the real drafter and the real verify batch and fakes only the accept decision,
so its tokens/s at a set accepted length is what a drafter of this shape would get on this machine if it were that
good. The speed-up at each length is tokens/s with the draft over the target alone on the same prompts (a ratio of
sums over prompts, with its interval); the break-even is the accepted length where the speed-up crosses 1, read by
linear interpolation between measured lengths, and the cycle cost (accepted length / speed-up) is what one verify
cycle costs in plain decoding steps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from harness.serving import metrics as names
from harness.serving.draft import ServedDraft
from harness.serving.server import LlamaServer, Session
from harness.serving.timing import bracketed
from harness.uncertainty import Estimate, ratio_estimate


@dataclass(frozen=True)
class SpeedPoint:
    """The server at one synthetic accepted length."""

    synthetic_length: float  # what the server was asked for
    accepted_length: float  # what it drew: 1 + accepted drafts / cycles over all requests
    speedup: Estimate  # tokens/s with the draft over the target alone, over prompts

    @property
    def cycle_cost(self) -> float:
        """Plain decoding steps one verify cycle costs: accepted length / speed-up."""
        return self.accepted_length / self.speedup.value


@dataclass(frozen=True)
class BreakEven:
    alone_tokens_per_s: float
    points: tuple[SpeedPoint, ...]  # by accepted length
    length: float  # where the speed-up crosses 1; inf when it never does within the block, 1 when it is above 1 at 1
    low: float  # from the speed-up's upper interval bounds (the earliest crossing the data allow)
    high: float  # from the lower bounds (inf when those never cross)

    @property
    def cycle_cost(self) -> float:
        """The cycle cost when nothing is accepted (the shortest measured length)."""
        return self.points[0].cycle_cost

    def metrics(self) -> dict[str, float]:
        values = {
            names.BREAK_EVEN: self.length,
            names.low(names.BREAK_EVEN): self.low,
            names.high(names.BREAK_EVEN): self.high,
            names.CYCLE_COST: self.cycle_cost,
            "alone_tokens_per_s_synthetic": self.alone_tokens_per_s,
        }
        for point in self.points:
            values[names.synthetic(point.synthetic_length, "accepted_length")] = point.accepted_length
            values[names.synthetic(point.synthetic_length, names.SPEEDUP)] = point.speedup.value
        return values

    def text(self) -> str:
        """`3.62 [3.41, 3.85]`, `above 8 (never within the block)` or `1 (pays at any length)`."""
        if math.isinf(self.length):
            return f"above {self.points[-1].accepted_length:.2f} (not reached within the block)"
        return interval_text(self.length, self.low, self.high)


def interval_text(length: float, low: float, high: float) -> str:
    """`3.62 [3.41, 3.85]`; an upper bound whose speed-up never reaches 1 within the block reads `not reached`;
    unknown bounds (one prompt) read `no interval`."""
    if math.isnan(low):
        return f"{length:.2f} (no interval: one prompt)"
    return f"{length:.2f} [{low:.2f}, {'not reached' if math.isinf(high) else f'{high:.2f}'}]"


def crossing(lengths: Sequence[float], speedups: Sequence[float]) -> float:
    """The first length where the piecewise-linear speed-up reaches 1; inf if it never does, the first length if it
    starts at or above 1; nan where a speed-up is unknown (the bound of an interval over one prompt)."""
    if any(math.isnan(s) for s in speedups):
        return math.nan
    if speedups[0] >= 1:
        return lengths[0]
    points = list(zip(lengths, speedups, strict=True))
    for (l0, s0), (l1, s1) in itertools.pairwise(points):
        if s0 < 1 <= s1:
            return l0 + (1 - s0) * (l1 - l0) / (s1 - s0)
    return math.inf


def synthetic_lengths(block: int, count: int = 3) -> tuple[float, ...]:
    """`count` evenly spaced accepted lengths from 1 (nothing accepted) to block + 1 (everything)."""
    return tuple(round(1 + block * i / (count - 1), 2) for i in range(count))


def measure(
    session: Session,
    model: Path,
    draft: ServedDraft,
    prompts: list[list[int]],
    n_predict: int,
    lengths: Sequence[float] | None = None,
) -> BreakEven:
    """Tokens/s of the target alone (bracketed: before and after) and with the draft's shape at each synthetic
    accepted length, on the same prompts."""
    lengths = lengths or synthetic_lengths(draft.block)

    def served(server: LlamaServer, desc: str) -> list:
        return [server.complete(p, n_predict, ignore_eos=True) for p in tqdm(prompts, desc=desc, unit="request")]

    def alone_pass(when: str) -> dict:
        with session.server(model, f"break-even-alone-{when}") as server:
            return {"prompts": served(server, f"break-even: target alone ({when})")}

    def synthetic() -> dict[float, list]:
        done = {}
        for length in lengths:
            with session.server(model, f"break-even-{length:g}", draft, synthetic_length=length) as server:
                done[length] = served(server, f"break-even: accepted length {length:g}")
        return done

    timed = bracketed(alone_pass, synthetic)
    alone = timed.alone_speeds()["prompts"]
    points = []
    for length, done in timed.drafted.items():
        cycles, accepted = sum(len(c.accepted) for c in done), sum(sum(c.accepted) for c in done)
        measured = 1 + accepted / cycles if cycles else float("nan")
        points.append(SpeedPoint(length, measured, ratio_estimate([c.tokens_per_s for c in done], alone)))
    points.sort(key=lambda point: point.accepted_length)
    measured_lengths = [p.accepted_length for p in points]
    return BreakEven(
        alone_tokens_per_s=sum(alone) / len(alone),
        points=tuple(points),
        length=crossing(measured_lengths, [p.speedup.value for p in points]),
        low=crossing(measured_lengths, [p.speedup.high for p in points]),
        high=crossing(measured_lengths, [p.speedup.low for p in points]),
    )
