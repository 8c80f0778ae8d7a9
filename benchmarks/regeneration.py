"""Data at scale: regeneration through llama-server's parallel slots against transformers' `generate`, on the same
conversations, and feature extraction against this CPU's own matmul rate, measured in the same run.

- Turns/s of both backends (the target's f32 GGUF conversion is done before the clock starts; it is once per work
  directory), and their agreement at T = 0 with the target's unpadded greedy decoding (transformers, one prompt at
  a time): identical replies, and for each that differs the first differing token with the target's top-2 logit
  gap there (a near-tie below 0.05).
- Feature extraction (the decoder's hidden states, no LM head) in tokens/s, the FLOP rate that implies
  (2 x decoder parameters per token), and the rate of a plain fp32 and bf16 matmul of the decoder's shapes: how
  close extraction runs to what the CPU can do.

    python -m benchmarks.regeneration --workdir work      # writes benchmarks/REGENERATION.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.budget_transfer import cpu_model
from harness.data import DataConfig, load_conversations, tokenize_conversation
from harness.decode import target_greedy
from harness.features import batch_features, final_dtype
from harness.regeneration import ENGINE, HF, Journal, regenerate, template_ids
from harness.served import cause_of
from harness.serving import find_engine, target_gguf
from harness.targets import load_target

OUT = Path(__file__).parent / "REGENERATION.md"


def timed_regeneration(target, conversations, config: DataConfig, workdir: Path) -> tuple[list, float]:
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        dialogues = regenerate(target, conversations, config, Journal(Path(scratch) / "journal.jsonl"), workdir)
        return dialogues, time.perf_counter() - started


def agreement(target, dialogues, references, prompts) -> tuple[int, list[str]]:
    """Replies identical to the greedy reference, and the cause of each that is not."""
    tokenizer = target.tokenizer
    same, causes = 0, []
    for prompt, reference, dialogue in zip(prompts, references, dialogues, strict=True):
        reply = dialogue[1]["content"]
        if reply == tokenizer.decode(reference, skip_special_tokens=True).strip():
            same += 1
        else:
            ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            causes.append(cause_of(target, prompt, reference, ids))
    return same, causes


def matmul_rate(dtype: torch.dtype, tokens: int, hidden: int, inner: int, repeats: int = 5) -> float:
    """FLOP/s of a (tokens x hidden) @ (hidden x inner) matmul, the decoder's MLP shape, best of `repeats`."""
    a, b = torch.randn(tokens, hidden, dtype=dtype), torch.randn(hidden, inner, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * tokens * hidden * inner / best


def extraction_rate(target, documents, layer_ids, batch_size: int = 8) -> float:
    """Tokens/s of the cache's own extraction step over `documents`."""
    tokens = sum(len(d.input_ids) for d in documents)
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(documents), batch_size):
            batch_features(target, documents[start : start + batch_size], layer_ids, final_dtype(target.dtype))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--conversations", type=int, default=64, help="chitchat conversations (default: 64)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per regenerated turn (default: 96)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server slots and HF batch (default: 16)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"markdown file (default: {OUT})")
    args = parser.parse_args()
    target = load_target("smollm2-135m", args.workdir)
    target_gguf(find_engine(), args.workdir, target)  # before the clock
    config = DataConfig(
        num_conversations=args.conversations,
        num_validation=1,
        max_new_tokens=args.tokens,
        generation_batch_size=args.slots,
    )
    conversations, _ = load_conversations(config, args.workdir)
    runs = {}
    for backend in (HF, ENGINE):
        runs[backend] = timed_regeneration(
            target, conversations, dataclasses.replace(config, regenerate_with=backend), args.workdir
        )
    tokenizer = target.tokenizer
    prompts = [template_ids(tokenizer, d[:1], add_generation_prompt=True) for d in runs[HF][0]]
    started = time.perf_counter()
    references = target_greedy(target.model, tokenizer, prompts, args.tokens, {tokenizer.eos_token_id})
    greedy_s = time.perf_counter() - started
    documents = [tokenize_conversation(tokenizer, d, 256) for d in runs[ENGINE][0]]
    spec = target.spec
    decoder_parameters = sum(p.numel() for p in target.model.base_model.layers.parameters())
    extraction = extraction_rate(target, documents, [2, 15, 27])
    rates = {dtype: matmul_rate(dtype, 2048, spec.hidden_size, 1536) for dtype in (torch.float32, torch.bfloat16)}
    rows = []
    for backend, (dialogues, seconds) in runs.items():
        same, causes = agreement(target, dialogues, references, prompts)
        near = sum("near-tie" in c and "not a near-tie" not in c for c in causes)
        rows.append(
            f"| {backend} | {len(dialogues) / seconds:.2f} | {seconds:.0f} | {same} of {len(dialogues)} | "
            f"{near} | {len(causes) - near} |"
        )
        for cause in causes:
            rows.append(f"|  |  |  |  | {cause} |  |")
    hf_s, engine_s = runs[HF][1], runs[ENGINE][1]
    implied = extraction * 2 * decoder_parameters
    text = "\n".join(
        [
            "# Regeneration and extraction at scale",
            "",
            f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {cpu_model()} ({os.cpu_count()} cores), llama.cpp "
            f"{find_engine().commit[:9]}, by `python -m benchmarks.regeneration --workdir {args.workdir} "
            f"--conversations {args.conversations} --tokens {args.tokens} --slots {args.slots}`.",
            "",
            f"## Regeneration: {args.conversations} chitchat first turns, {args.tokens} new tokens, T = 0",
            "",
            f"transformers' `generate` in batches of {args.slots} (left-padded, fp32) against `llama-server` from the "
            f"target's f32 GGUF with {args.slots} slots (continuous batching). *Same as greedy*: the reply equals the "
            "target's unpadded greedy decoding in transformers, one prompt at a time "
            f"({greedy_s:.0f} s for all). A reply that differs is named by its first differing token (after "
            "re-tokenising the reply) and the target's top-2 logit gap there.",
            "",
            "| backend | turns/s | wall (s) | same as greedy | near-ties | other |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            f"**llama.cpp regenerates {hf_s / engine_s:.1f}x as fast as transformers** on this machine; at this rate "
            f"the whole embedded chitchat set (about 4,000 conversations) takes about "
            f"{4000 / (args.conversations / engine_s) / 60:.0f} minutes.",
            "",
            "## Feature extraction",
            "",
            f"The cache's own step (`harness.features.batch_features`, batches of 8, the decoder only, fp32 on the "
            f"CPU) over those {len(documents)} regenerated documents ({sum(len(d.input_ids) for d in documents)} "
            f"tokens): **{extraction:.0f} tokens/s**, which is {implied / 1e9:.1f} GFLOP/s at 2 x "
            f"{decoder_parameters / 1e6:.0f}M decoder parameters per token (attention's own FLOPs left out). A plain "
            f"2048 x {spec.hidden_size} x 1536 matmul on this CPU: {rates[torch.float32] / 1e9:.1f} GFLOP/s in fp32, "
            f"{rates[torch.bfloat16] / 1e9:.1f} GFLOP/s in bf16. Extraction runs at "
            f"{implied / rates[torch.float32]:.0%} of the fp32 matmul rate: that rate bounds it. At "
            f"{extraction:.0f} tokens/s, 2,000 conversations of about 150 tokens take about "
            f"{2000 * 150 / extraction / 60:.0f} minutes.",
            "",
        ]
    )
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
