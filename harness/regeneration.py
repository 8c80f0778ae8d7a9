"""Regeneration: every assistant turn replaced by the target's own response, so the draft learns the distribution
it will be verified against.

Two backends decode the same templated prompt ids: transformers' `generate` in batches (any HF target), and
llama.cpp's `llama-server` from the target's f32 GGUF with several slots decoding at once (continuous batching),
2.3x as fast on a 2-core CPU. At T = 0 they agree token for token except where the target's top two logits
nearly tie (benchmarks/serving/REGENERATION.md). Finished turns are journaled as they land, so a killed regeneration
resumes without redoing them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

HF, ENGINE = "hf", "llama.cpp"
REGENERATORS = (HF, ENGINE)
# (conversation index, dialogue so far ending on a user turn, seed) -> the reply's text, for each as it lands
Replies = Callable[[list[tuple[int, list[dict], int]]], Iterator[tuple[int, str]]]


class Journal:
    """Finished turns, one JSON line each, appended and flushed as they land; a line torn by a kill is dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[tuple[int, int], str] = {}
        if path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):  # a line torn by a kill: cut, or the next entry would join it
                text = text[: text.rfind("\n") + 1]
                path.write_text(text)
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                self.done[entry["conversation"], entry["turn"]] = entry["reply"]
        if self.done:
            log.info("resuming: %d finished entries in %s", len(self.done), path)

    def add(self, conversation: int, turn: int, reply: str) -> None:
        self.done[conversation, turn] = reply
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as journal:
            journal.write(json.dumps({"conversation": conversation, "turn": turn, "reply": reply}) + "\n")


def user_prompts(conversation: list[dict], max_user_turns: int) -> list[str]:
    return [m["content"] for m in conversation if m["role"] == "user"][:max_user_turns]


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate(target, conversations: list[list[dict]], config, journal: Journal, workdir: Path) -> list[list[dict]]:
    """Every user turn (up to `max_user_turns`) answered by the target, turn by turn, with the configured backend."""
    prompts = [user_prompts(c, config.max_user_turns) for c in conversations]
    dialogues: list[list[dict]] = [[] for _ in conversations]
    backend = (
        engine_replies(target, config, workdir) if config.regenerate_with == ENGINE else hf_replies(target, config)
    )
    total = sum(len(p) for p in prompts)
    with (
        tqdm(total=total, desc=f"regenerating responses ({config.regenerate_with})", unit="turn") as bar,
        backend as replies,
    ):
        for turn in range(config.max_user_turns):
            active = [i for i, p in enumerate(prompts) if len(p) > turn]
            for i in active:
                dialogues[i].append({"role": "user", "content": prompts[i][turn]})
            pending = [i for i in active if (i, turn) not in journal.done]
            bar.update(len(active) - len(pending))
            requests = [(i, dialogues[i], config.seed * 1_000_003 + turn * 10_007 + i) for i in pending]
            for i, reply in replies(requests):
                journal.add(i, turn, reply)
                bar.update(1)
            for i in active:
                dialogues[i].append({"role": "assistant", "content": journal.done[i, turn]})
    return dialogues


@contextmanager
def hf_replies(target, config) -> Iterator[Replies]:
    """transformers' `generate`, `generation_batch_size` conversations at a time (left-padded)."""
    tokenizer, model = target.tokenizer, target.model
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device

    @torch.no_grad()
    def replies(requests):
        for start in range(0, len(requests), config.generation_batch_size):
            batch = requests[start : start + config.generation_batch_size]
            texts = [tokenizer.apply_chat_template(d, tokenize=False, add_generation_prompt=True) for _, d, _ in batch]
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            sampling = (
                dict(do_sample=True, temperature=config.generation_temperature)
                if config.generation_temperature > 0
                else dict(do_sample=False)
            )
            torch.manual_seed(batch[0][2])  # a batch's sampling depends only on the data seed and where it starts
            output = model.generate(
                **encoded, max_new_tokens=config.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
            for row, (i, _, _) in enumerate(batch):
                generated = output[row, encoded["input_ids"].shape[1] :]
                yield i, tokenizer.decode(generated, skip_special_tokens=True).strip()

    yield replies


@contextmanager
def engine_replies(target, config, workdir: Path) -> Iterator[Replies]:
    """`llama-server` with `generation_batch_size` slots, each request a slot's turn (harness/serving/parallel.py)."""
    from harness.serving.parallel import parallel_requests

    tokenizer, tokens = target.tokenizer, config.max_new_tokens
    slots = config.generation_batch_size
    # each slot holds a prompt shorter than max_length (a longer one is never sent) and its reply
    with parallel_requests(target, workdir, "regeneration", slots, config.max_length + tokens) as send:

        def replies(requests):
            jobs = []
            for i, dialogue, seed in requests:
                ids = template_ids(tokenizer, dialogue, add_generation_prompt=True)
                if len(ids) >= config.max_length:  # its document is cut at max_length before the reply: not sent
                    yield i, ""  # (no slot could hold it), and the document is the one the HF reply would have made
                else:
                    jobs.append((i, ids, tokens, config.generation_temperature, seed))
            for i, done in send(jobs):
                yield i, tokenizer.decode(done.tokens, skip_special_tokens=True).strip()

        yield replies
