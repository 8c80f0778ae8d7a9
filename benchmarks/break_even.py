"""The break-even of each drafter shape on this machine: llama.cpp's tokens/s at synthetic accepted lengths
(`--spec-synth-len`: the real drafter and verify batch, only the accept decision drawn) against the target alone,
for DFlash2 drafts of several block sizes and depths, with the f32 target (the agreement check's setting) and the
quantized target the package ships (Q4_1, what a user would serve).

A draft's cost does not depend on what it learned, so the drafts are freshly initialised: only their shape is
measured. Run it on a quiet machine (it times decoding):

    python -m benchmarks.break_even --workdir work        # writes benchmarks/BREAK_EVEN.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

from harness import break_even
from harness.evaluate import prompt_ids
from harness.export import export_checkpoint
from harness.mtbench import mtbench_questions
from harness.presets import preset_run
from harness.run import SERVED_DIR, server_records
from harness.served import served_shape
from harness.serving import find_engine, target_gguf, to_gguf
from harness.targets import embedded_gguf_path, load_target
from harness.train import build_for_target, with_target_defaults

OUT = Path(__file__).parent / "BREAK_EVEN.md"
TARGET = "smollm2-135m"


def draft_gguf(engine, target, workdir: Path, block: int, layers: int, outtype: str) -> tuple[Path, int, str]:
    """A freshly initialised DFlash2 draft of this shape, exported and converted once (to `outtype`): (GGUF, drafted
    tokens per cycle, llama.cpp's speculative type)."""
    config = preset_run("small", "dflash2", TARGET)
    config = with_target_defaults(
        type(config)(config.algorithm.replace(block_size=block, num_draft_layers=layers), config.train, config.data),
        target,
    )
    draft = build_for_target(config, target)
    shapes = workdir / SERVED_DIR / "break-even-shapes" / f"block{block}-layers{layers}"
    if not (shapes / "export" / "config.json").is_file():
        export_checkpoint(draft, shapes / "export", target.source)
    gguf = to_gguf(
        engine,
        shapes / "export",
        shapes / f"draft-{outtype}.gguf",
        f"a block-{block} draft",
        Path(target.source),
        outtype,
    )
    return gguf, *served_shape(draft)


def measure_all(args: argparse.Namespace) -> list[dict]:
    engine = find_engine()
    target = load_target(TARGET, args.workdir)
    targets = {
        "f32": target_gguf(engine, args.workdir, target),
        "Q4_1 (shipped)": embedded_gguf_path(TARGET),
    }
    prompts = [prompt_ids(target.tokenizer, q) for q in mtbench_questions(args.prompts)]
    logs = args.workdir / SERVED_DIR / "break-even-logs"
    results = []
    for block, layers in itertools.product(args.blocks, args.layers):
        gguf, drafted, spec_type = draft_gguf(engine, target, args.workdir, block, layers, args.draft_outtype)
        for name, model in targets.items():
            started = time.monotonic()
            found = break_even.measure(
                engine,
                model,
                gguf,
                drafted,
                spec_type,
                prompts,
                args.tokens,
                logs,
                server_records(args.workdir),
                lengths=break_even.synthetic_lengths(drafted, args.points),
            )
            took = time.monotonic() - started
            print(f"block {block}, {layers} layers, {name}: break-even {found.text()} ({took:.0f} s)")
            results.append({"block": block, "layers": layers, "target": name, "found": found})
    return results


def markdown(results: list[dict], args: argparse.Namespace, seconds: float) -> str:
    rows = []
    for result in results:
        found: break_even.BreakEven = result["found"]
        curve = ", ".join(f"{p.accepted_length:.2f}: {p.speedup.value:.2f}x" for p in found.points)
        rows.append(
            f"| {result['block']} | {result['layers']} | {result['target']} | {found.alone_tokens_per_s:.1f} | "
            f"{found.cycle_cost:.2f} | {found.text()} | {curve} |"
        )
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    flags = Path("/proc/cpuinfo").read_text()
    return "\n".join(
        [
            f"# Break-even: the accepted length at which a drafter pays for itself, by shape ({args.draft_outtype} "
            "draft)",
            "",
            f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {cpu} ({os.cpu_count()} cores, "
            f"{'native bf16' if 'avx512_bf16' in flags or 'amx_bf16' in flags else 'no native bf16'}), "
            f"llama.cpp {find_engine().commit[:9]}, in {seconds / 60:.1f} minutes, by `python -m benchmarks.break_even "
            f"--workdir {args.workdir} --prompts {args.prompts} --tokens {args.tokens} --points {args.points} "
            f"--draft-outtype {args.draft_outtype}`.",
            "",
            f"Target {TARGET} alone and with a freshly initialised DFlash2 draft converted to {args.draft_outtype} "
            f"GGUF (the `small` preset's knobs at each "
            f"block size and depth), at synthetic accepted lengths from 1 (nothing accepted) to the block, on the "
            f"first {args.prompts} MT-bench first turns, {args.tokens} new tokens each, T = 0 (`ignore_eos`). "
            "*Speed-up* is tokens/s with the draft over the target alone (a ratio of sums over prompts); *cycle cost* "
            "is accepted length / speed-up at length 1, in plain decoding steps; *break-even* is where the speed-up "
            "crosses 1 (linear between measured lengths), with the crossings of the speed-up's 95% interval bounds.",
            "",
            "| block | draft layers | target | alone tok/s | cycle cost | break-even | accepted length: speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (target and GGUF caches)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16], help="block sizes (default: 4 8 16)")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="draft layers (default: 1 2)")
    parser.add_argument("--prompts", type=int, default=5, help="MT-bench prompts (default: 5)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request (default: 128)")
    parser.add_argument("--points", type=int, default=5, help="synthetic accepted lengths per curve (default: 5)")
    parser.add_argument(
        "--draft-outtype",
        choices=("f32", "bf16", "q8_0"),
        default="f32",
        help="the draft GGUF's type (default: f32, what `evaluate --engine` serves)",
    )
    parser.add_argument("--out", type=Path, help=f"markdown file (default: {OUT}, or BREAK_EVEN_<TYPE>_DRAFT.md)")
    args = parser.parse_args()
    args.out = args.out or (
        OUT if args.draft_outtype == "f32" else OUT.with_name(f"BREAK_EVEN_{args.draft_outtype.upper()}_DRAFT.md")
    )
    started = time.monotonic()
    results = measure_all(args)
    args.out.write_text(markdown(results, args, time.monotonic() - started))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
