"""What serving costs a study per trial: the compared serving (`evaluate --engine`'s: harness decode, cycle-by-cycle
comparison, break-even, the target alone before and after) against the speed-only serving a served objective runs
(harness/serving/speed.py: rounds of fresh launches, with the draft and without), on one trained run, with the same
prompts and settings, one after the other in the same process. The GGUFs are converted before either is timed.

    python -m benchmarks.serving.served_cost --run instr-c1000-dflash2-b4 --workdir work

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.common.runs import load_run
from harness.config import EvalConfig
from harness.data import prepare_documents
from harness.evaluate import prompt_sets
from harness.run import SERVED_DIR
from harness.serving import metrics as served_names
from harness.serving.compare import serve_and_compare
from harness.serving.draft import served_draft
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Session
from harness.serving.speed import serve_speed

GROUP, PAGE = "serving", "SERVED_COST"


def measure(args: argparse.Namespace) -> Record:
    engine = find_engine()
    trained = load_run(args.run, args.workdir)
    run = trained.run
    target = trained.load_target()
    draft = trained.draft(target)
    documents = prepare_documents(target, trained.config.data, run.workdir).validation
    config = EvalConfig(
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperatures=(0.0,),
    )
    model = target_gguf(engine, run.workdir, target)  # both converted before anything is timed
    served_as = served_draft(engine, run, draft, target)

    started = time.perf_counter()
    compared, _ = serve_and_compare(engine, run, target, draft, documents, config)
    compared_s = time.perf_counter() - started

    session = Session.of(engine, run.workdir, run.path(SERVED_DIR))
    sets = prompt_sets(target.tokenizer, documents, config)
    speed, speed_s = {}, {}
    for rounds in args.rounds:
        started = time.perf_counter()
        speed[rounds] = serve_speed(session, model, served_as, sets, config.max_new_tokens, rounds).metrics()
        speed_s[rounds] = time.perf_counter() - started

    requests = sum(len(prompts) for prompts in sets.values())
    speedup, se = served_names.SPEEDUP, served_names.se(served_names.SPEEDUP)
    rows = [
        [
            "compared (`evaluate --engine`)",
            f"{compared_s:.0f}",
            "1.00",
            f"{compared[speedup]:.3f} ± {compared[se]:.3f} (over requests, one launch)",
            "harness decode, cycle comparison, break-even, n-gram types, alone before and after",
        ]
    ]
    for rounds in args.rounds:
        several = rounds > 1
        interval = "over rounds: launch noise inside" if several else "one launch: launch noise only between runs"
        error = f" ± {speed[rounds][se]:.3f}" if several else ""
        alternating = ", alternating which goes first" if several else ""
        rows.append(
            [
                f"speed only, {rounds} round{'s' * (rounds > 1)} (a served objective)",
                f"{speed_s[rounds]:.0f}",
                f"{speed_s[rounds] / compared_s:.2f}",
                f"{speed[rounds][speedup]:.3f}{error} ({interval})",
                f"{2 * rounds} launches: with the draft and without{alternating}",
            ]
        )
    title = f"Served cost per trial: run `{run.name}`, {requests} prompts, {args.max_new_tokens} new tokens, T = 0"
    about = (
        f"One trained run served both ways on the same {requests} prompts (MT-bench first turns and held-out chat, "
        f"{args.num_prompts} of each), {args.max_new_tokens} new tokens at T = 0, the compared serving first, then one "
        "speed-only serving per round count. Wall seconds from the served draft's GGUF on (both converted "
        "beforehand)."
    )
    values = {
        "run": run.name,
        "requests": requests,
        "max_new_tokens": args.max_new_tokens,
        "compared_s": compared_s,
        "speed_only_s": {str(r): t for r, t in speed_s.items()},
        "ratio": {str(r): t / compared_s for r, t in speed_s.items()},
        "compared": {k: v for k, v in compared.items() if isinstance(v, float | int)},
        "speed_only": {str(r): m for r, m in speed.items()},
    }
    table = Table(["serving", "wall s", "of compared", "speed-up ± SE", "what it runs"], rows)
    return Record(title, [about, table], values, Provenance.now(engine=engine.commit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained run (name or directory)")
    parser.add_argument("--workdir", type=Path, default=Path("work"))
    parser.add_argument("--num-prompts", type=int, default=6, help="MT-bench first turns, and as many chat prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, nargs="+", default=[1, 2], help="the speed-only serving's rounds, one serving each"
    )
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    page = Page.named(GROUP, args.page or PAGE).titled("Served cost per trial: compared against speed-only serving")
    found = measure(args)
    page.publish(found)


if __name__ == "__main__":
    main()
