"""The break-even of each drafter shape on this machine: llama.cpp's tokens/s at synthetic accepted lengths
(`--spec-synth-len`: the real drafter and verify batch, only the accept decision drawn) against the target alone,
for DFlash2 drafts of several block sizes and depths, with the f32 target (the agreement check's setting) and the
quantized target the package ships (Q4_1, what a user would serve).

A draft's cost does not depend on what it learned, so the drafts are freshly initialised: only their shape is
measured. Run it on a quiet machine (it times decoding):

    python -m benchmarks.serving.break_even --workdir work        # a record for benchmarks/serving/BREAK_EVEN.md
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.evaluate import prompt_ids
from harness.export import export_checkpoint
from harness.mtbench import mtbench_questions
from harness.presets import preset_run
from harness.run import SERVED_DIR
from harness.serving import break_even
from harness.serving.draft import ServedDraft, served_shape
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf, to_gguf
from harness.serving.server import Session
from harness.targets import embedded_gguf_path, load_target
from harness.train import build_for_target, with_target_defaults

GROUP, PAGE = "serving", "BREAK_EVEN"
TARGET = "smollm2-135m"


def shaped_draft(engine, target, workdir: Path, block: int, layers: int, outtype: str) -> ServedDraft:
    """A freshly initialised DFlash2 draft of this shape, exported and converted once (to `outtype`)."""
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
    return ServedDraft(f"block{block}-layers{layers}", "dflash2", gguf, *served_shape(draft))


def measure_all(args: argparse.Namespace) -> list[dict]:
    engine = find_engine()
    target = load_target(TARGET, args.workdir)
    targets = {
        "f32": target_gguf(engine, args.workdir, target),
        "Q4_1 (shipped)": embedded_gguf_path(TARGET),
    }
    prompts = [prompt_ids(target.tokenizer, q) for q in mtbench_questions(args.prompts)]
    session = Session.of(engine, args.workdir, args.workdir / SERVED_DIR / "break-even-logs")
    results = []
    for block, layers in itertools.product(args.blocks, args.layers):
        draft = shaped_draft(engine, target, args.workdir, block, layers, args.draft_outtype)
        for name, model in targets.items():
            started = time.monotonic()
            lengths = break_even.synthetic_lengths(draft.block, args.points)
            found = break_even.measure(session, model, draft, prompts, args.tokens, lengths)
            took = time.monotonic() - started
            print(f"block {block}, {layers} layers, {name}: break-even {found.text()} ({took:.0f} s)")
            results.append({"block": block, "layers": layers, "target": name, "found": found})
    return results


def record(results: list[dict], args: argparse.Namespace, seconds: float, engine) -> Record:
    rows, values = [], []
    for result in results:
        found: break_even.BreakEven = result["found"]
        curve = ", ".join(f"{p.accepted_length:.2f}: {p.speedup.value:.2f}x" for p in found.points)
        rows.append(
            [
                str(result["block"]),
                str(result["layers"]),
                result["target"],
                f"{found.alone_tokens_per_s:.1f}",
                f"{found.cycle_cost:.2f}",
                found.text(),
                curve,
            ]
        )
        values.append(
            {
                "block": result["block"],
                "layers": result["layers"],
                "target": result["target"],
                **{k: v for k, v in found.metrics().items() if math.isfinite(v)},
            }
        )
    about = (
        f"Target {TARGET} alone and with a freshly initialised DFlash2 draft converted to {args.draft_outtype} GGUF "
        f"(the `small` preset's knobs at each block size and depth), at synthetic accepted lengths from 1 (nothing "
        f"accepted) to the block, on the first {args.prompts} MT-bench first turns, {args.tokens} new tokens each, "
        "T = 0 (`ignore_eos`), in {:.1f} minutes. *Speed-up* is tokens/s with the draft over the target alone (a "
        "ratio of sums over prompts, the target alone timed before and after); *cycle cost* is accepted length / "
        "speed-up at length 1, in plain decoding steps; *break-even* is where the speed-up crosses 1 (linear "
        "between measured lengths), with the crossings of the speed-up's 95% interval bounds."
    ).format(seconds / 60)
    columns = ["block", "draft layers", "target", "alone tok/s", "cycle cost", "break-even", "accepted: speed-up"]
    return Record(
        f"{args.draft_outtype} draft, blocks {' '.join(map(str, args.blocks))}",
        [about, Table(columns, rows)],
        {"shapes": values},
        Provenance.now(engine=engine.commit),
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
    page_argument(parser, GROUP, f"{PAGE} (an f32 draft), or {PAGE}_<TYPE>_DRAFT")
    args = parser.parse_args()
    default = PAGE if args.draft_outtype == "f32" else f"{PAGE}_{args.draft_outtype.upper()}_DRAFT"
    args.page = Page.named(GROUP, args.page or default)
    started = time.monotonic()
    results = measure_all(args)
    written = args.page.add(record(results, args, time.monotonic() - started, find_engine()))
    print(f"recorded {written}; rendered {args.page.path}")


if __name__ == "__main__":
    main()
