"""One served draft cycle taken apart on this machine: where its time goes, beside the byte and FLOP estimate of
each part.

What llama.cpp computes per DFlash cycle (common/speculative.cpp and src/models/dflash.cpp at the pinned commit):
after each target decode, `process()` copies the target's hidden states of the new positions into the draft and
runs one draft decode that projects them into its K/V cache; `draft()` runs one draft decode of the noise block
(the anchor and `n_max` mask tokens) through the draft's layers and then the vocabulary head (the target's own
`output.weight` unless the draft GGUF carries its own with a `d2t` map), and for DFlash2 the selector's top-K
lattice, which the host walks; the target then verifies `n_max + 1` tokens in one batch.

Measured here, per target file and draft shape, on MT-bench first turns at T = 0:
- *plain token*: the target alone, one decoded token (`ignore_eos`);
- *verify batch of k*: the target evaluating a k-token prompt in one batch (the server's `prompt_ms`), which is what
  the verify step computes, at a short context;
- *cycle*: a freshly initialised draft served with llama.cpp's synthetic acceptance at length 1 (nothing
  accepted), so every cycle yields one token and the cycle's time is 1 / tokens/s; the draft side (its two decodes,
  the head, the host walk, the copies) is the cycle less the verify batch;
- a shorter draft (`--spec-draft-n-max` below the block) and the thread count as levers on the cycle.

The estimates: bytes each part reads (the GGUF's tensors) at the bandwidth a plain token reaches, and FLOPs.

    python -m benchmarks.serving.cycle_cost --workdir work            # a record for benchmarks/serving/CYCLE_COST.md

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.serving.break_even import shaped_draft
from harness.evaluate import prompt_ids
from harness.mtbench import mtbench_questions
from harness.run import SERVED_DIR
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import LlamaServer, Session
from harness.targets import embedded_gguf_path, load_target

GROUP, PAGE = "serving", "CYCLE_COST"
TARGET = "smollm2-135m"
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # the head, or the tied embedding that stands in for it


def gguf_bytes(path: Path) -> tuple[int, int, int]:
    """(all tensor bytes, the vocabulary head's bytes, parameters) of a GGUF; a draft that shares the target's head
    has none of its own (0)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    head = next((int(tensors[name].n_bytes) for name in HEAD_TENSORS if name in tensors), 0)
    return (
        sum(int(t.n_bytes) for t in tensors.values()),
        head,
        sum(int(t.n_elements) for t in tensors.values()),
    )


def median_ms(values: list[float]) -> float:
    return statistics.median(values)


def token_ms(server: LlamaServer, prompts: list[list[int]], tokens: int) -> float:
    """The median time per generated token: a plain token for the target alone; a whole cycle for a draft served at
    synthetic length 1, where every cycle yields one token."""
    return median_ms([1000 / server.complete(p, tokens, ignore_eos=True).tokens_per_s for p in prompts])


def batch_ms(server: LlamaServer, prompts: list[list[int]], k: int, repeats: int) -> float:
    """The target's evaluation of k tokens in one batch: the median `prompt_ms` of k-token prompts."""
    return median_ms([server.complete(p[:k], 1).prompt_ms for p in prompts for _ in range(repeats)])


def measure(args: argparse.Namespace) -> Record:
    engine = find_engine()
    target = load_target(TARGET, args.workdir)
    models = {"f32": target_gguf(engine, args.workdir, target), "Q4_1 (shipped)": embedded_gguf_path(TARGET)}
    models = {name: path for name, path in models.items() if name.split()[0].lower() in args.targets}
    prompts = [prompt_ids(target.tokenizer, q) for q in mtbench_questions(args.prompts)]
    session = Session.of(engine, args.workdir, args.workdir / SERVED_DIR / "cycle-cost-logs")
    drafts = {block: shaped_draft(engine, target, args.workdir, block, 1, "f32") for block in args.blocks}
    draft_bytes = {block: gguf_bytes(d.gguf)[0] for block, d in drafts.items()}
    rows, lever_rows, values = [], [], {}
    started = time.monotonic()
    for name, model in models.items():
        weights, head, parameters = gguf_bytes(model)
        largest = max(d.block for d in drafts.values()) + 1
        with session.server(model, f"alone-{name.split()[0]}") as server:
            plain = token_ms(server, prompts, args.tokens)
            batches = {k: batch_ms(server, prompts, k, args.repeats) for k in range(1, largest + 1)}
        bandwidth = weights / (plain / 1000)  # bytes/s a plain token reaches: decoding one token reads every weight
        values[name] = {"plain_ms": plain, "batch_ms": batches, "weights_bytes": weights, "head_bytes": head}
        for block, draft in drafts.items():
            with session.server(model, f"cycle-{name.split()[0]}-b{block}", draft, synthetic_length=1) as server:
                cycle = token_ms(server, prompts, args.tokens)
            verify = batches[draft.block + 1]
            draft_side = cycle - verify
            head_ms = head / bandwidth * 1000  # the head's weights, read once per block decode
            layers_ms = draft_bytes[block] / bandwidth * 1000
            values[name][f"block{block}"] = {"cycle_ms": cycle, "verify_ms": verify, "draft_side_ms": draft_side}
            rows.append(
                [
                    name,
                    str(block),
                    f"{plain:.1f}",
                    f"{verify:.1f} ({verify / plain:.2f})",
                    f"{draft_side:.1f} ({draft_side / plain:.2f})",
                    f"{cycle:.1f} ({cycle / plain:.2f})",
                    f"{head_ms:.1f} + {layers_ms:.1f}",
                    f"{2 * parameters * (draft.block + 1) / 1e9:.2f}",
                ]
            )
            for n_max in args.n_max:
                if n_max >= draft.block:
                    continue
                shorter = dataclasses.replace(draft, block=n_max)
                label = f"cycle-{name.split()[0]}-b{block}-n{n_max}"
                with session.server(model, label, shorter, synthetic_length=1) as server:
                    short_cycle = token_ms(server, prompts, args.tokens)
                values[name][f"block{block}_n_max{n_max}"] = short_cycle
                lever_rows.append(
                    [
                        name,
                        str(block),
                        f"n_max {n_max}",
                        f"{short_cycle:.1f} ({short_cycle / plain:.2f})",
                        f"{cycle:.1f}",
                    ]
                )
        for outtype in args.draft_types:  # the same draft's weights quantized (the head stays the target's)
            draft = shaped_draft(engine, target, args.workdir, args.blocks[0], 1, outtype)
            label = f"cycle-{name.split()[0]}-b{args.blocks[0]}-{outtype}"
            with session.server(model, label, draft, synthetic_length=1) as server:
                quantized = token_ms(server, prompts, args.tokens)
            values[name][f"block{args.blocks[0]}_{outtype}"] = quantized
            full = values[name][f"block{args.blocks[0]}"]["cycle_ms"]
            lever_rows.append(
                [
                    name,
                    str(args.blocks[0]),
                    f"a {outtype} draft",
                    f"{quantized:.1f} ({quantized / plain:.2f})",
                    f"{full:.1f}",
                ]
            )
        for threads in args.threads:
            draft = drafts[args.blocks[0]]
            options = {"threads": threads, "synthetic_length": 1}
            with session.server(model, f"cycle-{name.split()[0]}-t{threads}", draft, **options) as server:
                threaded = token_ms(server, prompts, args.tokens)
            with session.server(model, f"alone-{name.split()[0]}-t{threads}", threads=threads) as server:
                plain_threaded = token_ms(server, prompts, args.tokens)
            values[name][f"threads{threads}"] = {"cycle_ms": threaded, "plain_ms": plain_threaded}
            lever_rows.append(
                [
                    name,
                    str(args.blocks[0]),
                    f"{threads} threads",
                    f"{threaded:.1f} ({threaded / plain_threaded:.2f} of its own plain token, {plain_threaded:.1f})",
                    "–",
                ]
            )
    minutes = (time.monotonic() - started) / 60
    about = (
        f"{len(prompts)} MT-bench first turns, {args.tokens} new tokens each at T = 0, medians over prompts; verify "
        f"batches from {args.repeats} repeats per prompt; {os.cpu_count()} threads unless the lever says otherwise; "
        f"{minutes:.0f} minutes. Each time is in ms, and in plain target tokens in brackets. *Draft side* is the "
        "cycle less the verify batch: the draft's K/V injection and block decode, its vocabulary head, the host's "
        "work. *Estimate* is the bytes each draft-side part reads at the bandwidth a plain token reaches (the "
        "target's weights over its token time): the head (the target's `output.weight`, read once per block decode) "
        "+ the draft's own weights. *Verify GFLOP*: 2 x the target's parameters x the batch."
    )
    columns = [
        "target",
        "block",
        "plain token (ms)",
        "verify batch",
        "draft side",
        "cycle (length 1)",
        "estimate: head + draft (ms)",
        "verify GFLOP",
    ]
    blocks = [about, Table(columns, rows)]
    if lever_rows:
        blocks += [
            "**Levers on the cycle**: a shorter draft (`--spec-draft-n-max` below the block: fewer tokens in the "
            "block decode and in the verify batch), the draft's weights quantized (its layers and projections; the "
            "vocabulary head it reads is the target's own) and the thread count. *Cycle at the full block* is the "
            "f32 draft's.",
            Table(["target", "block", "lever", "cycle (length 1)", "cycle at the full block"], lever_rows),
        ]
    return Record(f"Blocks {' '.join(map(str, args.blocks))}", blocks, values, Provenance.now(engine=engine.commit))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (target and GGUF caches)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8], help="block sizes (default: 4 8)")
    parser.add_argument("--targets", nargs="+", default=["f32", "q4_1"], choices=["f32", "q4_1"])
    parser.add_argument("--prompts", type=int, default=5, help="MT-bench prompts (default: 5)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="verify-batch repeats per prompt (default: 3)")
    parser.add_argument(
        "--n-max", type=int, nargs="*", default=[1, 2], help="shorter drafts (default: 1 2; the flag alone: none)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=[1],
        help="thread counts as a lever (default: 1; the flag alone: none)",
    )
    parser.add_argument(
        "--draft-types",
        nargs="*",
        default=["q8_0"],
        choices=["f16", "bf16", "q8_0"],
        help="the first block's draft converted to these types as a lever (default: q8_0)",
    )
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    found = measure(args)
    page = Page.named(GROUP, args.page or PAGE).titled("One served draft cycle taken apart: where its time goes")
    page.publish(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
