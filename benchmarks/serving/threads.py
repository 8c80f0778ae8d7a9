"""Servers side by side on one machine: each server's decode speed when it runs alone and when others decode at
the same moment, per thread count. llama.cpp's worker threads spin at each operation's barrier (`--poll`), so a
server with more threads than its share of the cores waits on threads that are not running.

This is why a server computes on `OMP_NUM_THREADS` threads where the caller set one (harness/serving/server.py,
`thread_budget`): pytest's two workers each start servers, and each worker's commands take one thread.

    python -m benchmarks.serving.threads --workdir work      # a record for benchmarks/serving/THREADS.md

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.evaluate import prompt_ids
from harness.mtbench import mtbench_questions
from harness.run import SERVED_DIR
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Session
from harness.targets import load_target

GROUP, PAGE = "serving", "THREADS"
TARGET = "smollm2-135m"


def side_by_side(session: Session, model: Path, servers: int, threads: int, prompts: list[list[int]], tokens: int):
    """Each of `servers` servers' tokens/s per prompt, every server decoding the same prompt at the same moment."""
    rates: list[list[float]] = [[] for _ in range(servers)]
    with ExitStack() as stack:
        started = [
            stack.enter_context(session.server(model, f"threads-{servers}x{threads}-{i}", threads=threads))
            for i in range(servers)
        ]
        with ThreadPoolExecutor(servers) as pool:
            for prompt in prompts:
                done = pool.map(lambda server, p=prompt: server.complete(p, tokens, ignore_eos=True), started)
                for rate, completion in zip(rates, done, strict=True):
                    rate.append(completion.tokens_per_s)
    return rates


def measure(args: argparse.Namespace) -> Record:
    engine = find_engine()
    target = load_target(TARGET, args.workdir)
    model = target_gguf(engine, args.workdir, target)
    prompts = [prompt_ids(target.tokenizer, q) for q in mtbench_questions(args.prompts)]
    session = Session.of(engine, args.workdir, args.workdir / SERVED_DIR / "threads-logs")
    shapes = [(servers, threads) for threads in args.threads for servers in args.servers]
    rates = {shape: side_by_side(session, model, *shape, prompts, args.tokens) for shape in shapes}
    medians = {shape: [statistics.median(r) for r in found] for shape, found in rates.items()}
    values = {f"{s}x{t}": {"tokens_per_s": rates[s, t], "median": medians[s, t]} for s, t in shapes}
    rows = []
    for servers, threads in shapes:
        speeds, alone = medians[servers, threads], medians.get((1, threads))
        of_alone = f"{speeds[0] / alone[0]:.2f}" if alone else "not measured"
        row = [servers, threads, servers * threads, " / ".join(f"{m:.1f}" for m in speeds), f"{sum(speeds):.1f}"]
        rows.append([str(cell) for cell in row] + [of_alone])
    title = (
        f"Servers side by side: the f32 target, {len(prompts)} MT-bench prompts, {args.tokens} tokens each, "
        f"{os.cpu_count()} cores"
    )
    about = (
        "Each row starts its servers together and sends every prompt to all of them at the same moment (ignore_eos, "
        "T = 0); a server's speed is its median tokens/s over the prompts. *Of alone* is the first server's speed "
        "against one server of the same thread count alone."
    )
    columns = ["servers", "threads each", "threads in all", "tokens/s per server", "tokens/s in all", "of alone"]
    return Record(title, [about, Table(columns, rows)], values, Provenance.now(engine=engine.commit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"))
    parser.add_argument("--prompts", type=int, default=4, help="MT-bench first turns")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="threads per server")
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="servers side by side")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    page = Page.named(GROUP, args.page or PAGE).titled("Servers side by side: decode speed per thread count")
    page.publish(measure(args))


if __name__ == "__main__":
    main()
