"""Data at scale: regeneration through llama-server's parallel slots against transformers' `generate`, on the same
conversations, and feature extraction against this CPU's own matmul rate, measured in the same run.

- Turns/s of both backends (the target's f32 GGUF conversion is done before the clock starts; it is once per work
  directory), and their agreement at T = 0 with the target's unpadded greedy decoding (transformers, one prompt at
  a time): identical replies, and for each that differs the first differing token with the target's top-2 logit
  gap there (a near-tie below 0.05).
- Feature extraction (the decoder's hidden states, no LM head) in tokens/s, the FLOP rate that implies
  (2 x decoder parameters per token), and the rate of a plain fp32 and bf16 matmul of the decoder's shapes: how
  close extraction runs to what the CPU can do.

    python -m benchmarks.serving.regeneration --workdir work      # a record for benchmarks/serving/REGENERATION.md
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.extraction import extracted, matmul_rate
from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.data import DataConfig, load_conversations, tokenize_conversation
from harness.decode import target_greedy
from harness.regeneration import ENGINE, HF, Journal, regenerate, template_ids
from harness.serving.compare import cause_of
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.targets import load_target

GROUP, PAGE = "serving", "REGENERATION"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--conversations", type=int, default=64, help="chitchat conversations (default: 64)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per regenerated turn (default: 96)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server slots and HF batch (default: 16)")
    page_argument(parser, GROUP, PAGE)
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
    _, extraction = extracted(target, documents, [2, 15, 27])
    rates = {dtype: matmul_rate(dtype, 2048, spec.hidden_size, 1536) for dtype in (torch.float32, torch.bfloat16)}
    rows, values = [], {}
    for backend, (dialogues, seconds) in runs.items():
        same, causes = agreement(target, dialogues, references, prompts)
        near = sum("near-tie" in c and "not a near-tie" not in c for c in causes)
        row = [backend, f"{len(dialogues) / seconds:.2f}", f"{seconds:.0f}", f"{same} of {len(dialogues)}"]
        rows.append([*row, str(near), str(len(causes) - near)])
        rows += [["", "", "", "", cause, ""] for cause in causes]
        values[backend] = {"turns_per_s": len(dialogues) / seconds, "same_as_greedy": same, "near_ties": near}
    hf_s, engine_s = runs[HF][1], runs[ENGINE][1]
    implied = extraction * 2 * decoder_parameters
    values["extraction_tokens_per_s"] = extraction
    values["matmul_gflops"] = {str(dtype).removeprefix("torch."): rate / 1e9 for dtype, rate in rates.items()}
    regeneration = [
        f"**Regeneration**: {args.conversations} chitchat first turns, {args.tokens} new tokens, T = 0. transformers' "
        f"`generate` in batches of {args.slots} (left-padded, fp32) against `llama-server` from the target's f32 GGUF "
        f"with {args.slots} slots (continuous batching). *Same as greedy*: the reply equals the target's unpadded "
        f"greedy decoding in transformers, one prompt at a time ({greedy_s:.0f} s for all). A reply that differs is "
        "named by its first differing token (after re-tokenising the reply) and the target's top-2 logit gap there.",
        Table(["backend", "turns/s", "wall (s)", "same as greedy", "near-ties", "other"], rows),
        f"llama.cpp regenerates {hf_s / engine_s:.1f}x as fast as transformers on this machine; at this rate the "
        f"whole embedded chitchat set (about 4,000 conversations) takes about "
        f"{4000 / (args.conversations / engine_s) / 60:.0f} minutes.",
    ]
    extraction_text = (
        f"**Feature extraction**: the cache's own step (`harness.features.batch_features`, batches of 8, the decoder "
        f"only, fp32 on the CPU) over those {len(documents)} regenerated documents "
        f"({sum(len(d.input_ids) for d in documents)} tokens): {extraction:.0f} tokens/s, which is "
        f"{implied / 1e9:.1f} GFLOP/s at 2 x {decoder_parameters / 1e6:.0f}M decoder parameters per token (attention's "
        f"own FLOPs left out). A plain 2048 x {spec.hidden_size} x 1536 matmul on this CPU: "
        f"{rates[torch.float32] / 1e9:.1f} GFLOP/s in fp32, {rates[torch.bfloat16] / 1e9:.1f} GFLOP/s in bf16. "
        f"Extraction runs at {implied / rates[torch.float32]:.0%} of the fp32 matmul rate. At {extraction:.0f} "
        f"tokens/s, 2,000 conversations of about 150 tokens take about {2000 * 150 / extraction / 60:.0f} minutes."
    )
    found = Record(
        f"{args.conversations} conversations, {args.slots} slots",
        [*regeneration, extraction_text],
        values,
        Provenance.now(engine=find_engine().commit),
    )
    page = Page.named(GROUP, args.page or PAGE)
    page.publish(found)


if __name__ == "__main__":
    main()
