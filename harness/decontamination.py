"""Training prompts never hold an evaluation prompt: a conversation whose user turns share any run of
`RUN_WORDS` consecutive words with one of MT-bench's 160 turns is dropped (a paraphrase that keeps a clause
whole is caught; reworded prose is not), and the count is logged."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from harness.mtbench import mtbench_records

RUN_WORDS = 10
WORD = re.compile(r"[a-z0-9]+")


def word_runs(text: str, length: int = RUN_WORDS) -> set[tuple[str, ...]]:
    """Every run of `length` consecutive words, lower-cased, punctuation and spacing ignored."""
    words = WORD.findall(text.lower())
    return {tuple(words[i : i + length]) for i in range(len(words) - length + 1)}


@dataclass(frozen=True)
class Decontaminator:
    """The word runs of the evaluation prompts, and the test a training conversation must pass."""

    runs: frozenset[tuple[str, ...]]

    @classmethod
    def mtbench(cls) -> Decontaminator:
        return cls.of(turn for question in mtbench_records() for turn in question["turns"])

    @classmethod
    def of(cls, prompts: Iterable[str]) -> Decontaminator:
        return cls(frozenset(run for prompt in prompts for run in word_runs(prompt)))

    def contaminated(self, messages: list[dict]) -> bool:
        """Whether any user turn shares a run of words with an evaluation prompt."""
        return any(
            not self.runs.isdisjoint(word_runs(m["content"]))
            for m in messages
            if m.get("role") == "user" and isinstance(m.get("content"), str)
        )
