"""Magpie (Xu et al. 2024): the aligned target writes the user instructions itself, given only its chat template's
text before a user turn (the default system turn, then the user header), sampled at T = 1 until its end-of-turn.

Left alone, a chat model asks mostly for advice, so each instruction is steered to one of MT-bench's eight
categories by a forced opening ("Solve", "Extract", ...), taken in turn. An instruction is kept when it ended by
itself (not cut at the token budget), has a few words, is mostly ASCII and was not written before. Every sampled
instruction is journaled as it lands, so a killed synthesis resumes without sampling a finished one again; the
journal is keyed by the target, the seed and the sampling settings. The instructions are then answered by the
target like any other prompts (harness/regeneration.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from harness.regeneration import Journal
from harness.serving.parallel import parallel_requests

log = logging.getLogger(__name__)

MAGPIE = "magpie"
# One forced opening per MT-bench category, taken in turn: the target completes the instruction after it.
OPENINGS = {
    "writing": "Write",
    "roleplay": "Imagine you are",
    "reasoning": "If",
    "math": "Solve",
    "coding": "Write a Python function",
    "extraction": "Extract",
    "stem": "Explain how",
    "humanities": "Discuss",
}
TEMPERATURE = 1.0
MAX_TOKENS = 96  # an instruction still open after this many tokens is dropped, not cut
MIN_WORDS = 4
GIVE_UP = 20  # tries per instruction asked for before a target that writes none usable is refused
SENTINEL = "\x00MAGPIE\x00"  # the user turn's place in the rendered template


def pre_query_ids(tokenizer) -> list[int]:
    """The template's text before a user turn's content (its default system turn and the user header), as ids
    without an extra BOS."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return tokenizer(rendered[: rendered.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def category(index: int) -> str:
    return list(OPENINGS)[index % len(OPENINGS)]


def instruction_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def kept(instruction: str, ended: bool) -> bool:
    text = instruction.strip()
    from harness.data import mostly_ascii  # the sharegpt source's test: harness.data imports this module

    return ended and len(text.split()) >= MIN_WORDS and mostly_ascii(text)


class MagpieJournal(Journal):
    """Sampled instructions by index (`turn` 0), each with whether it ended by itself."""

    def instruction(self, index: int) -> tuple[str, bool] | None:
        entry = self.done.get((index, 0))
        return None if entry is None else (entry[1:], entry[0] == "+")

    def add_instruction(self, index: int, text: str, ended: bool) -> None:
        self.add(index, 0, ("+" if ended else "-") + text)


def synthesize(
    target, count: int, seed: int, slots: int, workdir: Path, accept: Callable[[str], bool] = lambda text: True
) -> tuple[list[str], int]:
    """`count` kept instructions, sampled from index 0 on: the first `count` that pass the filter and `accept` (the
    caller's decontamination), in index order, so a resumed or repeated synthesis keeps the same ones; and how many
    `accept` refused."""
    from harness.data import stable_hash

    key = stable_hash(
        {"target": target.weights_hash, "seed": seed, "t": TEMPERATURE, "max": MAX_TOKENS, "openings": OPENINGS}
    )
    journal = MagpieJournal(workdir / "data" / f"magpie-{key}.jsonl")
    prefix = pre_query_ids(target.tokenizer)
    chosen: list[str] = []
    seen: set[str] = set()
    start = refused = 0
    with (
        tqdm(total=count, desc="magpie: instructions written by the target", unit="prompt") as bar,
        instruction_sampler(target, prefix, seed, slots, workdir) as sample,
    ):
        while len(chosen) < count:
            if start >= GIVE_UP * count + 100:
                raise ValueError(
                    f"invalid --data={MAGPIE!r}: the target wrote {len(chosen)} usable instructions of the {count} "
                    f"asked for in {start} tries; allowed fewer --num-conversations, or a mixture with other sources"
                )
            # enough new indices for what is missing at the acceptance seen so far, at least a slot's worth each
            rate = max(0.2, len(chosen) / start) if start else 1.0
            indices = range(start, start + max(slots, math.ceil((count - len(chosen)) / rate)))
            pending = [i for i in indices if journal.instruction(i) is None]
            for landed, (index, text, ended) in enumerate(sample(pending), start=1):
                journal.add_instruction(index, text, ended)
                bar.set_postfix_str(f"{landed}/{len(pending)} of this round sampled", refresh=landed % 16 == 0)
            for index in indices:
                text, ended = journal.instruction(index)
                text = text.strip()
                if len(chosen) == count or not kept(text, ended) or text.lower() in seen:
                    continue
                seen.add(text.lower())
                if accept(text):
                    chosen.append(text)
                    bar.update(1)
                else:
                    refused += 1
            start = indices.stop
    log.info("magpie: kept %d of %d instructions the target wrote (%s)", len(chosen), start, journal.path)
    return chosen, refused


@contextmanager
def instruction_sampler(target, prefix: list[int], seed: int, slots: int, workdir: Path) -> Iterator:
    """`sample(indices)` yields (index, instruction, ended by itself) as each lands, `slots` decoding at once in
    `llama-server` (harness/serving/parallel.py)."""
    tokenizer = target.tokenizer
    with parallel_requests(target, workdir, "magpie", slots, len(prefix) + MAX_TOKENS + 8) as send:

        def sample(indices: list[int]) -> Iterator[tuple[int, str, bool]]:
            jobs = []
            for index in indices:
                opening_ids = tokenizer(OPENINGS[category(index)], add_special_tokens=False)["input_ids"]
                jobs.append((index, prefix + opening_ids, MAX_TOKENS, TEMPERATURE, instruction_seed(seed, index)))
            for index, done in send(jobs):
                text = OPENINGS[category(index)] + tokenizer.decode(done.tokens, skip_special_tokens=True)
                yield index, text, len(done.tokens) < MAX_TOKENS

        yield sample
