"""The way to a drafter that pays for itself: served accepted length and speed-up against training data and steps.

Serves every finished run whose name matches `--runs` (WSD trunks and their branches, at several data sizes and
block sizes) in llama.cpp with the f32 target, on the same MT-bench first turns and each run's own held-out chat
prompts, 128 new tokens at T = 0; the target alone is timed before and after, and each drafter's break-even is
measured once per draft shape in the same launch. One table and one plot:

    python -m benchmarks.serving.speedup_curve --workdir work --runs 'curve-*'    # a record for serving/SPEEDUP.md

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import time
from dataclasses import dataclass
from pathlib import Path

from algorithms.dflash import DFlashDraft
from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from benchmarks.common.records import Page, Provenance, Record, Table
from benchmarks.serving.speedup import CHAT, GROUP, PAGE, prompts_by_category, reply_length, serving_arguments
from harness import tracking
from harness.data import PreparedData, prepare_documents
from harness.evaluate import chat_prompt_ids
from harness.run import SERVED_DIR, Run, runs_root
from harness.serving import break_even
from harness.serving import metrics as served_names
from harness.serving.compare import accepted_length
from harness.serving.draft import ServedDraft, served_draft
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Session, complete_all
from harness.serving.timing import bracketed, mean_speed
from harness.train import TrainedRun
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
class Curved:
    """A finished run of the curve, loaded once: the run, its draft, the draft as served and its data."""

    trained: TrainedRun
    draft: DFlashDraft
    served: ServedDraft
    data: PreparedData

    @property
    def data_key(self) -> tuple[int, int]:
        """Runs with the same data share their held-out chat prompts."""
        return self.trained.config.data.num_conversations, self.trained.config.data.seed


def finished_runs(workdir: Path, pattern: str) -> list[TrainedRun]:
    """Runs under `workdir` whose name matches `pattern` and whose checkpoint reached its budget."""
    found = []
    for path in sorted(runs_root(workdir).iterdir()):
        run = Run(workdir, path.name)
        if fnmatch.fnmatch(path.name, pattern) and run.has_checkpoint():
            trained = TrainedRun.load(run)
            if trained.state["step"] == trained.config.train.max_steps:
                found.append(trained)
    return found


def loaded(engine, trained: TrainedRun, target) -> Curved:
    draft = trained.draft(target)
    data = prepare_documents(target, trained.config.data, trained.run.workdir)
    return Curved(trained, draft, served_draft(engine, trained.run, draft, target), data)


def wall_minutes(run: Run) -> float | None:
    """The run's MLflow wall time: first start to last end (a resumed run's pause included)."""
    seconds = tracking.wall_seconds(tracking.client(run.workdir).get_run(run.run_id).info)
    return None if seconds is None else seconds / 60


def point_of(curved: Curved, served: dict, alone: dict[str, list[float]]) -> Point:
    """One point of the curve: the run's served completions against the target alone on the same prompts."""
    run, config, block = curved.trained.run, curved.trained.config, curved.served.block
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
        train_tokens=sum(sum(d.loss_mask) for d in curved.data.train),
        steps=config.train.max_steps,
        branch_of=config.train.branch_of,
        realized=curved.trained.state["history"][-1][REALIZED_ACCEPTED_LENGTH],
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
    target = found[0].load_target()
    f32_target = target_gguf(engine, args.workdir, target)
    runs = [loaded(engine, trained, target) for trained in found]
    mtbench = prompts_by_category(target.tokenizer, args.per_category)
    # each data set's held-out chat prompts, timed with the target alone too, so each point is paired by prompt
    chat_prompts = {curved.data_key: chat_prompt_ids(curved.data.validation, args.chat) for curved in runs}
    session = Session.of(engine, args.workdir, args.workdir / SERVED_DIR / "speedup-curve")
    started = time.monotonic()
    ignore_eos = not args.until_eos

    def alone_pass(tag: str) -> dict:
        with session.server(f32_target, f"alone-{tag}") as server:
            return complete_all(server, {**mtbench, **chat_prompts}, args.tokens, ignore_eos)

    def drafted() -> tuple[list[dict], dict]:
        served, shapes = [], {}
        for curved in runs:
            prompts = {**mtbench, CHAT: chat_prompts[curved.data_key]}
            with Session.of(engine, args.workdir, curved.trained.run.path(SERVED_DIR)).server(
                f32_target, "speedup-curve", curved.served
            ) as server:
                served.append(complete_all(server, prompts, args.tokens, ignore_eos))
            shape = curved.served.shape
            if shape not in shapes:
                flat = [p for group in mtbench.values() for p in group][: args.break_even_prompts]
                lengths = break_even.synthetic_lengths(curved.served.block, 5)
                shapes[shape] = break_even.measure(session, f32_target, curved.served, flat, args.tokens, lengths)
        return served, shapes

    timed = bracketed(alone_pass, drafted)
    alone, (served, shapes) = timed.alone_speeds(), timed.drafted
    points = []
    for curved, completions in zip(runs, served, strict=True):
        point = point_of(curved, completions, {**{c: alone[c] for c in mtbench}, CHAT: alone[curved.data_key]})
        point.break_even = shapes[curved.served.shape]
        points.append(point)
        print(f"{point.run}: accepted {point.accepted:.2f}, speed-up {point.speedup.text()}", flush=True)
    minutes = (time.monotonic() - started) / 60
    return render(args, engine, points, mean_speed(timed.before), mean_speed(timed.after), minutes), points


def render(args, engine, points: list[Point], before: float, after: float, minutes: float) -> Record:
    columns = [
        "run",
        "algorithm",
        "block",
        "conversations (supervised tokens)",
        "steps",
        "offline realized",
        "served accepted length",
        "speed-up [95%]",
        "chat alone: accepted, speed-up",
        "tokens from drafts",
        "break-even",
        "training (min)",
    ]
    rows = []
    for p in points:
        lineage = f" (branch of `{p.branch_of}`)" if p.branch_of else ""
        rows.append(
            [
                f"`{p.run}`{lineage}",
                p.algorithm,
                str(p.block),
                f"{p.conversations} ({p.train_tokens:,})",
                str(p.steps),
                f"{p.realized:.3f}",
                f"{p.accepted:.2f}",
                p.speedup.text(),
                f"{p.chat_accepted:.2f}, {p.chat_speedup.text()}",
                f"{p.drafted_share:.1%}",
                p.break_even.text(),
                f"{p.train_minutes:.1f}" if p.train_minutes is not None else "–",
            ]
        )
    best = max(points, key=lambda p: p.speedup.value)
    about = (
        f"{minutes:.0f} min, f32 target. Prompts: MT-bench first turns ({args.per_category} per category) and "
        f"{args.chat} of each run's held-out chat conversations, {reply_length(args)}, T = 0. The target alone ran "
        f"{before:.1f} tokens/s before the drafts and {after:.1f} after; each speed-up is paired by prompt with the "
        "mean of the two. Break-even: llama.cpp's synthetic acceptance for the draft's shape, in this launch."
    )
    values = {
        p.run: {
            "realized": p.realized,
            "accepted": p.accepted,
            served_names.SPEEDUP: [p.speedup.value, p.speedup.low, p.speedup.high],
            "break_even": p.break_even.length if math.isfinite(p.break_even.length) else None,
        }
        for p in points
    }
    return Record(
        f"The curve: {args.runs}",
        [
            about,
            Table(columns, rows),
            f"Best: `{best.run}`, accepted length {best.accepted:.2f}, speed-up {best.speedup.text()}, against a "
            f"break-even of {best.break_even.text()}.",
            f"![served accepted length and speed-up against training]({args.plot.name})",
        ],
        values,
        Provenance.now(engine=engine.commit),
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
    found, points = measure(args)
    plot(points, args.plot)
    page = Page.named(GROUP, PAGE)
    page.publish(found)


if __name__ == "__main__":
    main()
