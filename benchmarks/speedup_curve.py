"""The way to a drafter that pays for itself: served accepted length and speed-up against training data and steps.

Serves every finished run whose name matches `--runs` (WSD trunks and their branches, at several data sizes and
block sizes) in llama.cpp with the f32 target, on the same MT-bench first turns and each run's own held-out chat
prompts, 128 new tokens at T = 0; the target alone is timed before and after, and each drafter's break-even is
measured once per draft shape in the same launch. One table and one plot:

    python -m benchmarks.speedup_curve --workdir work --runs 'curve-*'     # appends to benchmarks/SPEEDUP.md

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from algorithms.dflash import DFlashDraft
from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from benchmarks.budget_transfer import cpu_model
from benchmarks.speedup import (
    CHAT,
    OUT,
    alone_speed,
    bracketed,
    prompts_by_category,
    reply_length,
    serve_all,
    serving_arguments,
)
from harness import break_even, tracking
from harness.config import RunConfig
from harness.data import PreparedData, prepare_documents
from harness.evaluate import chat_prompt_ids
from harness.run import SERVED_DIR, Run, runs_root, server_records
from harness.served import accepted_length, draft_gguf, served_shape
from harness.serving import LlamaServer, find_engine, target_gguf
from harness.targets import load_target
from harness.train import checkpoint_config, restore_draft
from harness.uncertainty import Estimate, ratio_estimate

PLOT = Path(__file__).parent / "speedup_curve.png"


@dataclass
class Point:
    """One served run of the curve."""

    run: str
    algorithm: str
    block: int
    layers: int
    conversations: int
    train_tokens: int
    steps: int
    branch_of: str | None
    realized: float  # offline, the final validation's
    accepted: float  # served, over drafting cycles
    speedup: Estimate
    chat_accepted: float  # served on the held-out chat prompts alone: the training distribution
    chat_speedup: Estimate
    drafted_share: float
    train_minutes: float | None
    break_even: break_even.BreakEven | None = None


@dataclass
class Trained:
    """A finished run of the curve, loaded once: its checkpoint, config, draft, the draft's GGUF and its data."""

    run: Run
    state: dict
    config: RunConfig
    draft: DFlashDraft
    gguf: Path
    data: PreparedData

    @property
    def data_key(self) -> tuple[int, int]:
        """Runs with the same data share their held-out chat prompts."""
        return self.config.data.num_conversations, self.config.data.seed


def finished_runs(workdir: Path, pattern: str) -> list[tuple[Run, dict]]:
    """Runs under `workdir` whose name matches `pattern` and whose checkpoint reached its budget, with it."""
    found = []
    for path in sorted(runs_root(workdir).iterdir()):
        run = Run(workdir, path.name)
        if fnmatch.fnmatch(path.name, pattern) and run.has_checkpoint():
            state = run.load_checkpoint()
            if state["step"] == checkpoint_config(state).train.max_steps:
                found.append((run, state))
    return found


def loaded(engine, run: Run, state: dict, target) -> Trained:
    config = checkpoint_config(state)
    draft = restore_draft(state, target)
    data = prepare_documents(target, config.data, run.workdir)
    return Trained(run, state, config, draft, draft_gguf(engine, run, draft, target), data)


def wall_minutes(run: Run) -> float | None:
    """The run's MLflow wall time: first start to last end (a resumed run's pause included)."""
    seconds = tracking.wall_seconds(tracking.client(run.workdir).get_run(run.run_id).info)
    return None if seconds is None else seconds / 60


def serve_run(engine, f32_target: Path, trained: Trained, prompts: dict, args: argparse.Namespace) -> dict:
    """The run's draft served on `prompts`: each category's completions."""
    block, spec_type = served_shape(trained.draft)
    log = trained.run.path(SERVED_DIR) / "speedup-curve.log"
    records = server_records(trained.run.workdir)
    with LlamaServer(engine, f32_target, log, records, trained.gguf, block, spec_type) as server:
        return serve_all(server, prompts, args.tokens, not args.until_eos)


def point_of(trained: Trained, served: dict, alone: dict[str, list[float]]) -> Point:
    """One point of the curve: the run's served completions against the target alone on the same prompts."""
    run, config = trained.run, trained.config
    block, _ = served_shape(trained.draft)
    completions = [c for group in served.values() for c in group]
    speed = [c.tokens_per_s for c in completions]
    baseline = [v for category in served for v in alone[category]]
    chat = served[CHAT]
    return Point(
        run=run.name,
        algorithm=config.algorithm.algorithm,
        block=block + 1,
        layers=config.algorithm.shared.num_draft_layers,
        conversations=config.data.num_conversations,
        train_tokens=sum(sum(d.loss_mask) for d in trained.data.train),
        steps=config.train.max_steps,
        branch_of=config.train.branch_of,
        realized=trained.state["history"][-1][REALIZED_ACCEPTED_LENGTH],
        accepted=accepted_length([a for c in completions for a in c.accepted]),
        speedup=ratio_estimate(speed, baseline),
        chat_accepted=accepted_length([a for c in chat for a in c.accepted]),
        chat_speedup=ratio_estimate([c.tokens_per_s for c in chat], alone[CHAT]),
        drafted_share=sum(c.draft_n_accepted for c in completions) / sum(len(c.tokens) for c in completions),
        train_minutes=wall_minutes(run),
    )


def measure(args: argparse.Namespace) -> tuple[str, list[Point]]:
    engine = find_engine()
    found = finished_runs(args.workdir, args.runs)
    if not found:
        raise SystemExit(f"error: invalid --runs={args.runs!r}: no finished run of that name in {args.workdir}")
    first = checkpoint_config(found[0][1])
    target = load_target(first.target, args.workdir, first.algorithm.shared.mask_token_id)
    f32_target = target_gguf(engine, args.workdir, target)
    runs = [loaded(engine, run, state, target) for run, state in found]
    mtbench = prompts_by_category(target.tokenizer, args.per_category)
    # each data set's held-out chat prompts, timed with the target alone too, so each point is paired by prompt
    chat_prompts = {trained.data_key: chat_prompt_ids(trained.data.validation, args.chat) for trained in runs}
    records, logs = server_records(args.workdir), args.workdir / SERVED_DIR / "speedup-curve"
    started = time.monotonic()

    def alone_pass(tag: str) -> dict:
        with LlamaServer(engine, f32_target, logs / f"alone-{tag}.log", records) as server:
            timed = serve_all(server, mtbench, args.tokens, not args.until_eos)
            for key, prompts in chat_prompts.items():
                timed[key] = [server.complete(p, args.tokens, ignore_eos=not args.until_eos) for p in prompts]
        return timed

    before = alone_pass("before")
    served, shapes = [], {}
    for trained in runs:
        served.append(serve_run(engine, f32_target, trained, {**mtbench, CHAT: chat_prompts[trained.data_key]}, args))
        shape = served_shape(trained.draft), trained.config.algorithm.shared.num_draft_layers
        if shape not in shapes:
            (block, spec_type), _ = shape
            flat = [p for group in mtbench.values() for p in group][: args.break_even_prompts]
            shapes[shape] = break_even.measure(
                engine, f32_target, trained.gguf, block, spec_type, flat, args.tokens, logs, records,
                lengths=break_even.synthetic_lengths(block, 5),
            )  # fmt: skip
    after = alone_pass("after")
    alone = bracketed(before, after)
    points = []
    for trained, completions in zip(runs, served, strict=True):
        point = point_of(trained, completions, {**{c: alone[c] for c in mtbench}, CHAT: alone[trained.data_key]})
        point.break_even = shapes[served_shape(trained.draft), trained.config.algorithm.shared.num_draft_layers]
        points.append(point)
        print(f"{point.run}: accepted {point.accepted:.2f}, speed-up {point.speedup.text()}", flush=True)
    minutes = (time.monotonic() - started) / 60
    return render(args, engine, points, alone_speed(before), alone_speed(after), minutes), points


def render(args, engine, points: list[Point], before: float, after: float, minutes: float) -> str:
    rows = [
        "| run | algorithm | block | conversations (supervised tokens) | steps | offline realized | served accepted "
        "length | speed-up [95%] | chat alone: accepted, speed-up | tokens from drafts | break-even | training (min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        lineage = f" (branch of `{p.branch_of}`)" if p.branch_of else ""
        train = f"{p.train_minutes:.1f}" if p.train_minutes is not None else "–"
        rows.append(
            f"| `{p.run}`{lineage} | {p.algorithm} | {p.block} | {p.conversations} ({p.train_tokens:,}) | {p.steps} | "
            f"{p.realized:.3f} | {p.accepted:.2f} | {p.speedup.text()} | {p.chat_accepted:.2f}, "
            f"{p.chat_speedup.text()} | {p.drafted_share:.1%} | "
            f"{p.break_even.text()} | {train} |"
        )
    best = max(points, key=lambda p: p.speedup.value)
    return "\n".join(
        [
            f"## The curve: {args.runs} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"{cpu_model()} ({os.cpu_count()} cores), llama.cpp {engine.commit[:9]}, f32 target; `python -m "
            f"benchmarks.speedup_curve --workdir {args.workdir} --runs '{args.runs}' --per-category "
            f"{args.per_category} --chat {args.chat} --tokens {args.tokens}{' --until-eos' * args.until_eos}"
            f"{f' --plot {args.plot}' * (args.plot != PLOT)}` "
            f"({minutes:.0f} min). Prompts: MT-bench first turns ({args.per_category} per category) and {args.chat} "
            f"of each run's held-out chat conversations, {reply_length(args)}, T = 0. The target alone ran "
            f"{before:.1f} tokens/s before the drafts and {after:.1f} after; each speed-up is paired by prompt with "
            "the mean of the two. Break-even: llama.cpp's synthetic acceptance for the draft's shape, in this launch.",
            "",
            *rows,
            "",
            f"Best: `{best.run}`, accepted length {best.accepted:.2f}, speed-up {best.speedup.text()}, against a "
            f"break-even of {best.break_even.text()}.",
            "",
            f"![served accepted length and speed-up against training]({args.plot.name})",
            "",
        ]
    )


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault((p.algorithm, p.block, p.conversations), []).append(p)
    for (algorithm, block, conversations), group in sorted(groups.items()):
        group.sort(key=lambda p: p.steps)
        label = f"{algorithm}, block {block}, {conversations} conversations"
        left.plot([p.steps for p in group], [p.accepted for p in group], "o-", label=label)
        right.errorbar(
            [p.steps for p in group],
            [p.speedup.value for p in group],
            yerr=[[p.speedup.value - p.speedup.low for p in group], [p.speedup.high - p.speedup.value for p in group]],
            fmt="o-",
            capsize=3,
            label=label,
        )
        if group[0].break_even is not None and math.isfinite(group[0].break_even.length):
            left.axhline(group[0].break_even.length, linestyle=":", color=left.lines[-1].get_color())
    right.axhline(1.0, color="black", linewidth=0.8)
    left.set(xlabel="training steps", ylabel="served accepted length", title="accepted length (dotted: break-even)")
    right.set(xlabel="training steps", ylabel="speed-up over the target alone", title="served speed-up, 95% interval")
    left.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(parser)
    parser.add_argument("--runs", required=True, help="run names to serve, a shell pattern (e.g. 'curve-*')")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"the plot written (default: {PLOT.name} here)")
    args = parser.parse_args()
    section, points = measure(args)
    plot(points, args.plot)
    with open(OUT, "a") as out:
        out.write(section + "\n")
    print(section)


if __name__ == "__main__":
    main()
