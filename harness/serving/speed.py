"""A draft's served speed alone, for studies: tokens/s with the draft against the target alone, in rounds.

Each round launches the server afresh twice, once with the draft and once without, over the same prompts at T = 0,
and its speed-up is the mean tokens/s with the draft over the mean without. Rounds alternate which pass goes first
(alone then drafted, drafted then alone, ...), so a machine that drifts during a serving moves both sides alike. The
run's speed-up is the mean over rounds, and its standard error is the spread between rounds: launch-to-launch noise
is inside it. No harness decode, no cycle comparison, no break-even: those are `evaluate --engine`'s (compare.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from harness.serving import metrics as names
from harness.serving.draft import ServedDraft
from harness.serving.server import Completion, Session
from harness.serving.timing import Passes, mean_speed
from harness.uncertainty import mean_estimate


@dataclass(frozen=True)
class SpeedRound:
    """One round: every prompt served by a fresh server with the draft and by a fresh one without."""

    drafted: Passes
    alone: Passes
    drafted_first: bool

    @property
    def speedup(self) -> float:
        return mean_speed(self.drafted) / mean_speed(self.alone)


@dataclass(frozen=True)
class ServedSpeed:
    rounds: tuple[SpeedRound, ...]

    def completions(self) -> list[Completion]:
        return [c for r in self.rounds for group in r.drafted.values() for c in group]

    def records(self) -> list[dict]:
        """Per round: which pass went first, its speed-up, and every request's tokens/s and accepted counts."""
        return [
            {
                "round": number,
                "drafted_first": r.drafted_first,
                "speedup": r.speedup,
                "requests": [
                    {
                        "set": name,
                        "prompt": index,
                        "tokens_per_s_draft": drafted.tokens_per_s,
                        "tokens_per_s_alone": alone.tokens_per_s,
                        "accepted": drafted.accepted,
                    }
                    for name, group in r.drafted.items()
                    for index, (drafted, alone) in enumerate(zip(group, r.alone[name], strict=True))
                ],
            }
            for number, r in enumerate(self.rounds)
        ]

    def metrics(self) -> dict[str, float]:
        """The speed-up over rounds with its launch-noise interval, speeds, and the served accepted length (per
        request, over every round's requests: the same prompts at T = 0 draw the same cycles up to near-ties)."""
        speedups = [r.speedup for r in self.rounds]
        speedup = mean_estimate(speedups)
        lengths = mean_estimate([1 + sum(c.accepted) / len(c.accepted) for c in self.completions() if c.accepted])
        return {
            names.SPEEDUP: speedup.value,
            names.se(names.SPEEDUP): speedup.se,
            names.low(names.SPEEDUP): speedup.low,
            names.high(names.SPEEDUP): speedup.high,
            names.ROUNDS: len(speedups),
            names.LAUNCH_VARIANCE: statistics.variance(speedups) if len(speedups) > 1 else float("nan"),
            names.TOKENS_PER_S_DRAFT: statistics.fmean(mean_speed(r.drafted) for r in self.rounds),
            names.TOKENS_PER_S_ALONE: statistics.fmean(mean_speed(r.alone) for r in self.rounds),
            names.ACCEPTED_GREEDY: lengths.value,
            names.se(names.ACCEPTED_GREEDY): lengths.se,
        }


def serve_speed(
    session: Session,
    model: Path,
    draft: ServedDraft,
    prompt_sets: dict[str, list[list[int]]],
    n_predict: int,
    rounds: int,
) -> ServedSpeed:
    """`rounds` rounds of a drafted and an alone pass over every prompt set, each pass its own server launch."""

    def served(drafter: ServedDraft | None, round_number: int) -> Passes:
        what = "with the draft" if drafter else "alone"
        name = f"speed-{round_number}-{'draft' if drafter else 'alone'}"
        with session.server(model, name, drafter) as server:
            return {
                set_name: [
                    server.complete(p, n_predict)
                    for p in tqdm(prompts, desc=f"round {round_number + 1}/{rounds}: {set_name} {what}", unit="request")
                ]
                for set_name, prompts in prompt_sets.items()
            }

    done = []
    for number in range(rounds):
        drafted_first = number % 2 == 1
        if drafted_first:
            drafted = served(draft, number)
            alone = served(None, number)
        else:
            alone = served(None, number)
            drafted = served(draft, number)
        done.append(SpeedRound(drafted, alone, drafted_first))
    return ServedSpeed(tuple(done))
