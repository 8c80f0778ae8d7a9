"""Where served acceptance falls below the offline one: a trained run's draft decoded by the harness (which agrees
with llama.cpp cycle by cycle) from its own validation prompts to the prompts and settings the speed-up benchmark
serves, one change per row: fewer drafted tokens (`--spec-draft-n-max`), the reduced draft vocabulary, held-out
instructions of another source, MT-bench, and the served window (the cycles that start in the first tokens of a
reply). Each row's accepted length is the mean over prompts of each prompt's mean over its cycles, with a 95%
interval over prompts; position k is the share of cycles that drafted slot k and had it accepted, among those
whose slots before k were accepted.

    python -m benchmarks.serving.acceptance_gap --workdir work --run speedup-c4000-seed0 --n-max 2 --vocabulary 4096

It times nothing, so it runs beside other work.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.common.runs import load_run
from benchmarks.serving.speedup import prompts_by_category
from harness.data import held_out_conversations, prepare_documents
from harness.decode import speculative_generate
from harness.evaluate import chat_prompt_ids, prompt_ids
from harness.serving.draft import reduced_vocabulary
from harness.uncertainty import mean_estimate

GROUP, PAGE = "serving", "ACCEPTANCE_GAP"


@dataclass(frozen=True)
class Decoded:
    """One prompt's decoding: each cycle's committed tokens, in order."""

    cycles: list[int]

    def within(self, window: int | None) -> list[int]:
        """The cycles that start within the reply's first `window` tokens (all without one); the first token
        comes from the prompt's own pass."""
        if window is None:
            return self.cycles
        kept, start = [], 1
        for length in self.cycles:
            if start >= window:
                break
            kept.append(length)
            start += length
        return kept


def position_rates(cycles: list[int], drafted: int) -> list[float]:
    """Per drafted slot, accepted among the cycles whose earlier slots were all accepted (a cycle that committed
    L tokens accepted L - 1 drafted ones)."""
    rates = []
    for slot in range(1, drafted + 1):
        reached = [length for length in cycles if length >= slot]
        rates.append(sum(length > slot for length in reached) / len(reached) if reached else float("nan"))
    return rates


def decode_set(trained, target, draft, prompts, args, drafted: int, vocabulary) -> list[Decoded]:
    stop = {target.tokenizer.eos_token_id}
    decoded = []
    for prompt in tqdm(prompts, desc=f"decode {trained.run.name}", unit="prompt", leave=False):
        stats = speculative_generate(
            target.model, draft, prompt, args.tokens, stop, max_draft=drafted, vocabulary=vocabulary
        )
        decoded.append(Decoded(stats.acceptance_lengths))
    return decoded


def row_values(decoded: list[Decoded], drafted: int, window: int | None) -> dict:
    per_prompt = [cycles for d in decoded if (cycles := d.within(window))]
    estimate = mean_estimate([sum(c) / len(c) for c in per_prompt])
    pooled = [length for cycles in per_prompt for length in cycles]
    return {
        "accepted_length": [estimate.value, estimate.low, estimate.high],
        "positions": position_rates(pooled, drafted),
        "cycles": len(pooled),
        "prompts": len(per_prompt),
    }


def measure_run(name: str, args: argparse.Namespace) -> tuple[list, dict]:
    trained = load_run(name, args.workdir)
    target = trained.load_target()
    draft = trained.draft(target).eval()
    documents = prepare_documents(target, trained.config.data, trained.run.workdir)
    vocabulary = torch.tensor(reduced_vocabulary(target, documents.train, args.vocabulary))
    block = draft.block_size - draft.shared.first_draft_slot
    try:
        held = held_out_conversations(trained.config.data, args.chat_data, args.prompts, trained.run.workdir)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    by_category = prompts_by_category(target.tokenizer, max(1, args.prompts // 8))
    sets = {
        "validation": chat_prompt_ids(documents.validation, args.prompts),
        f"held-out {args.chat_data}": [prompt_ids(target.tokenizer, c[0]["content"]) for c in held],
        "MT-bench": [p for group in by_category.values() for p in group],
    }
    vocab = f"{args.vocabulary} tokens"
    steps = [  # (prompt set, drafted, vocabulary); a draft trained at the served length skips the second
        ("validation", block, None),
        *([("validation", args.n_max, None)] if args.n_max != block else []),
        ("validation", args.n_max, vocabulary),
        (f"held-out {args.chat_data}", args.n_max, vocabulary),
        ("MT-bench", args.n_max, vocabulary),
    ]
    history = (trained.state.get("history") or [{}])[-1]
    offline = history.get(REALIZED_ACCEPTED_LENGTH)
    offline_positions = [history.get(f"realized_position_{k}_conditional_acc") for k in range(1, block + 1)]
    rows = [
        [
            "validation documents, offline (`val/realized_accepted_length`, every anchor)",
            str(len(documents.validation)),
            str(block),
            "whole",
            "whole replies",
            "-" if offline is None else f"{offline:.3f}",
            " / ".join("-" if p is None else f"{p:.2f}" for p in offline_positions),
        ]
    ]
    values: dict = {"offline": {"accepted_length": offline, "positions": offline_positions}}
    decoded_sets: dict[tuple, list[Decoded]] = {}
    for prompt_set, drafted, restricted in steps:
        decoded = decode_set(trained, target, draft, sets[prompt_set], args, drafted, restricted)
        decoded_sets[(prompt_set, drafted, restricted is not None)] = decoded
        found = row_values(decoded, drafted, None)
        key = f"{prompt_set}, {drafted} drafted, {'reduced' if restricted is not None else 'whole'} vocabulary"
        values[key] = found
        rows.append(
            cells(prompt_set, drafted, vocab if restricted is not None else "whole", f"up to {args.tokens}", found)
        )
    served = [d for s in list(sets)[1:] for d in decoded_sets[(s, args.n_max, True)]]
    found = row_values(served, args.n_max, args.window)
    values[f"served prompts, first {args.window} tokens"] = found
    rows.append(
        cells(" + ".join(list(sets)[1:]), args.n_max, vocab, f"cycles starting in the first {args.window}", found)
    )
    return rows, values


def cells(prompt_set: str, drafted: int, vocabulary: str, tokens: str, found: dict) -> list[str]:
    value, low, high = found["accepted_length"]
    positions = " / ".join(f"{p:.2f}" for p in found["positions"])
    return [
        prompt_set,
        f"{found['prompts']} ({found['cycles']} cycles)",
        str(drafted),
        vocabulary,
        tokens,
        f"{value:.3f} [{low:.3f}, {high:.3f}]",
        positions,
    ]


def measure(args: argparse.Namespace) -> Record:
    blocks, values = [], {}
    for name in args.run:
        rows, values[name] = measure_run(name, args)
        columns = [
            "prompts",
            "prompts (cycles)",
            "drafted",
            "draft vocabulary",
            "new tokens",
            "accepted length [95%]",
            "position 1 / 2 / ...",
        ]
        blocks += [f"**`{name}`**", Table(columns, rows)]
    about = (
        f"Harness greedy decoding (T = 0, stopping at the reply's end or {args.tokens} tokens) of each run's draft "
        f"with its f32 target. Prompt sets of {args.prompts}: the run's first validation conversations up to their "
        f"first reply; first user turns of `{args.chat_data}` past the run's share of it (never trained on); MT-bench "
        f"first turns, {max(1, args.prompts // 8)} per category. The reduced vocabulary is the run's training replies' "
        f"{args.vocabulary} most frequent tokens, as the served reduced draft's. Each row changes one thing from the "
        "row above; the last reads the two served sets' decodings of the row above within the served window."
    )
    return Record(
        "Acceptance from offline to served: " + ", ".join(f"`{n}`" for n in args.run),
        [about, *blocks],
        values,
        Provenance.now(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--run", required=True, action="append", help="a trained run (name or directory); repeatable")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set (default: 16)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens at most per prompt (default: 128)")
    parser.add_argument("--n-max", type=int, default=2, help="drafted tokens per cycle, as served (default: 2)")
    parser.add_argument("--vocabulary", type=int, default=4096, help="the reduced draft vocabulary (default: 4096)")
    parser.add_argument("--window", type=int, default=64, help="the served reply length (default: 64)")
    parser.add_argument(
        "--chat-data", default="sharegpt", help="the source of held-out instructions (default: sharegpt)"
    )
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    page = Page.named(GROUP, args.page or PAGE).titled("Acceptance from offline to served: one change at a time")
    page.publish(measure(args))


if __name__ == "__main__":
    main()
