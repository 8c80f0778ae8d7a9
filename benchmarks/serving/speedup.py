"""The served speed-up as users measure it: tokens/s with a trained draft over the target alone, in llama.cpp, on
MT-bench first turns by category and held-out chat prompts, at T = 0 and a fixed number of new tokens (or up to each
reply's end, `--until-eos`), with a 95% interval, each drafter paired with the target alone timed
before and after it; beside it, in the same run and on the same prompts, llama.cpp's training-free speculation
(the n-gram types), and the draft's break-even on this machine. With the f32 target (the agreement check's setting)
and the shipped Q4_1 target (what a user serves).

    python -m benchmarks.serving.speedup --workdir work --run RUN      # a record for benchmarks/serving/SPEEDUP.md
    python -m benchmarks.serving.speedup --run SEED0 --run SEED1 --rounds 2   # seed and launch noise inside

With `--rounds R` everything is served R times, each round in fresh launches, and a drafter's interval is over its
rounds; runs that differ only in their training seed are pooled into a recipe row whose interval is over seeds.
`--vocabulary N` adds each draft over its replies' N most frequent tokens, `--n-max N` each draft drafting at most N
tokens per cycle, `--p-min P` each draft with llama.cpp's confidence cut at P (its cycles end at the first
unconfident token, so the verify batch shrinks).

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.common.runs import load_run
from harness.config import RunConfig
from harness.data import data_identity, held_out_conversations, prepare_documents, stable_hash
from harness.evaluate import chat_prompt_ids, prompt_ids
from harness.mtbench import mtbench_records
from harness.run import SERVED_DIR
from harness.serving import break_even
from harness.serving import metrics as served_names
from harness.serving.compare import accepted_length
from harness.serving.draft import ServedDraft, reduced_draft, served_draft
from harness.serving.engine import EngineError, find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Completion, Session, complete_all
from harness.serving.timing import bracketed, mean_speed
from harness.targets import embedded_gguf_path
from harness.train import TrainedRun
from harness.uncertainty import mean_estimate, ratio_estimate

GROUP, PAGE = "serving", "SPEEDUP"
CHAT = "chat (held-out)"


def prompts_by_category(tokenizer, per_category: int) -> dict[str, list[list[int]]]:
    found: dict[str, list[list[int]]] = defaultdict(list)
    for record in mtbench_records():
        if len(found[record["category"]]) < per_category:
            found[record["category"]].append(prompt_ids(tokenizer, record["turns"][0]))
    return dict(found)


def row(name: str, rounds: list[dict[str, list[Completion]]], alone: list[dict[str, list[float]]]) -> tuple[list, dict]:
    """Speed-up overall and per category against the bracketed alone speeds of the same round, and what the drafts
    did: accepted length over drafting cycles, and the share of generated tokens that came from accepted drafts;
    with the raw numbers. Over several rounds the overall interval is over the rounds' speed-ups (launch noise
    inside); within one, over prompts."""
    per_round = [
        ratio_estimate(
            [c.tokens_per_s for group in served.values() for c in group],
            [v for group in speeds.values() for v in group],
        )
        for served, speeds in zip(rounds, alone, strict=True)
    ]
    overall = per_round[0] if len(per_round) == 1 else mean_estimate([e.value for e in per_round])
    completions = [c for served in rounds for group in served.values() for c in group]
    cycles = [a for c in completions for a in c.accepted]
    tokens = sum(len(c.tokens) for c in completions)
    by_category = {
        category: ratio_estimate(
            [c.tokens_per_s for served in rounds for c in served[category]],
            [v for speeds in alone for v in speeds[category]],
        )
        for category in alone[0]
    }
    per_category = " · ".join(f"{category} {found.text()}" for category, found in by_category.items())
    values = {
        served_names.SPEEDUP: [overall.value, overall.low, overall.high],
        "rounds": [e.value for e in per_round],
        "accepted_length": accepted_length(cycles) if cycles else None,
        "tokens_from_drafts": sum(c.draft_n_accepted for c in completions) / tokens if tokens else None,
        "by_category": {category: [e.value, e.low, e.high] for category, e in by_category.items()},
    }
    return [name, overall.text(), *drafting_cells(values), per_category], values


def drafting_cells(values: dict) -> list[str]:
    """A row's accepted length and share of tokens from drafts, as the table shows them."""
    accepted, share = values["accepted_length"], values["tokens_from_drafts"]
    return [f"{accepted:.2f}" if accepted is not None else "no drafts", f"{share:.1%}" if share is not None else "-"]


def with_cuts(
    served: list[tuple[ServedDraft, TrainedRun]], n_max: list[int], p_min: list[float], cut_only: bool = False
) -> list[tuple[ServedDraft, TrainedRun]]:
    """Each draft, then each again drafting n of its block's tokens for each n below it (llama.cpp's
    --spec-draft-n-max), then each of those again with each confidence cut (--spec-draft-p-min); `cut_only` leaves
    the whole-block drafts out."""
    cut = [
        (dataclasses.replace(draft, name=f"{draft.name} (n-max {n})", block=n), trained)
        for draft, trained in served
        for n in n_max
        if n < draft.block
    ]
    served = cut if cut_only else served + cut
    return served + [
        (dataclasses.replace(draft, name=f"{draft.name} (p-min {p:g})", confidence_cut=p), trained)
        for draft, trained in served
        for p in p_min
    ]


def recipe_rows(drafts: list[tuple[ServedDraft, TrainedRun]], found: dict[str, dict]) -> list[tuple[list, dict]]:
    """One row per recipe served at two or more training seeds (runs whose configs differ only in the seed, served
    at the same vocabulary): the mean over seeds of each seed's mean over rounds, with a t interval over seeds, so
    that seed and launch noise are both inside it."""
    groups: dict[tuple[str, int | None], list[tuple[ServedDraft, TrainedRun]]] = defaultdict(list)
    for draft, trained in drafts:
        config = trained.config
        recipe = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=0)).fingerprint()
        groups[recipe, draft.block, draft.vocabulary, draft.confidence_cut].append((draft, trained))
    rows = []
    for members in groups.values():
        if len({trained.config.train.seed for _, trained in members}) < 2:
            continue
        seed_means = [statistics.fmean(found[draft.label]["rounds"]) for draft, _ in members]
        pooled = mean_estimate(seed_means)
        rounds = len(found[members[0][0].label]["rounds"])
        names = ", ".join(f"`{trained.run.name}`" for _, trained in members)
        shown = members[0][0]
        variant = "".join(f", {part}" for part in variant_parts(shown))
        name = f"**recipe** {names} ({len(members)} seeds x {rounds} round{'s' * (rounds > 1)}{variant})"
        weights = [found[draft.label] for draft, _ in members]
        accepted = [w["accepted_length"] for w in weights if w["accepted_length"] is not None]
        shares = [w["tokens_from_drafts"] for w in weights if w["tokens_from_drafts"] is not None]
        values = {
            "label": name,
            "block": shown.block + 1,
            "trained_block": members[0][1].config.algorithm.shared.block_size,  # before an n-max cut
            "layers": shown.layers,
            "vocabulary": shown.vocabulary,
            "confidence_cut": shown.confidence_cut,
            served_names.SPEEDUP: [pooled.value, pooled.low, pooled.high],
            "seed_means": seed_means,
            "seed_accepted": [w["accepted_length"] for w in weights],  # each seed's, over its rounds
            "accepted_length": statistics.fmean(accepted) if accepted else None,
            "tokens_from_drafts": statistics.fmean(shares) if shares else None,
        }
        rows.append(([name, pooled.text(), *drafting_cells(values), "-"], values))
    return rows


def variant_parts(draft: ServedDraft) -> list[str]:
    """How a served draft differs from its run's own, as its name says after the run's: `vocabulary 4096`,
    `n-max 2`, `p-min 0.5`."""
    return re.findall(r"\(([^)]*)\)", draft.name.removeprefix(draft.gguf.parent.parent.name))


def log_name(draft: ServedDraft) -> str:
    """`draft-RUN`, `draft-RUN-vocabulary4096-pmin0.5`: a server log's name, without the label's spaces."""
    return f"draft-{draft.gguf.parent.parent.name}" + "".join(
        "-" + re.sub(r"[^a-z0-9.]", "", part) for part in variant_parts(draft)
    )


@dataclass
class Launches:
    """One target model's llama-server launches in this benchmark: each serves the same prompts, alone, with a
    trained draft or with an n-gram type, and logs under its own name."""

    session: Session
    model: Path
    tag: str
    prompts: dict[str, list[list[int]]]
    args: argparse.Namespace

    def serve(self, name: str, draft: ServedDraft | None = None, **options) -> dict[str, list[Completion]]:
        with self.session.server(self.model, f"{self.tag}-{name}", draft, **options) as server:
            return complete_all(server, self.prompts, self.args.tokens, not self.args.until_eos)


TARGET_FILES = {"f32": "f32", "q4_1": "Q4_1 (shipped)"}


def measure(args: argparse.Namespace) -> Record:
    engine = find_engine()
    runs = [load_run(name, args.workdir) for name in args.run]
    launch = launch_config([(t.run.name, t.config) for t in runs], args.chat_data)
    workdir = runs[0].run.workdir
    target = runs[0].load_target()
    served = [(served_draft(engine, trained.run, trained.draft(target), target), trained) for trained in runs]
    if args.vocabulary:  # each draft again over the tokens its training replies use most (FR-Spec)
        replies, loaded = {}, {}  # runs of one data config (its seeds) load its documents once
        for trained in runs:
            identity = stable_hash(data_identity(trained.config.data))
            if identity not in loaded:
                loaded[identity] = prepare_documents(target, trained.config.data, workdir).train
            replies[trained.run.name] = loaded[identity]
        try:
            served += [
                (reduced_draft(engine, trained.run, draft, target, replies[trained.run.name], size), trained)
                for draft, trained in list(served)
                for size in args.vocabulary
            ]
        except EngineError as error:
            raise SystemExit(f"error: {error}") from None
        if args.reduced_only:  # the whole-vocabulary drafts measured before: their launches are not spent again
            served = [(draft, trained) for draft, trained in served if draft.vocabulary]
    served = with_cuts(served, args.n_max, args.p_min, args.cut_only)
    drafts = [draft for draft, _ in served]
    prompts = prompts_by_category(target.tokenizer, args.per_category)
    if args.chat and args.chat_data is None:  # the runs' held-out conversations, up to their first reply
        prompts[CHAT] = chat_prompt_ids(prepare_documents(target, launch.data, workdir).validation, args.chat)
    elif args.chat:  # a source's first user turns that the runs never saw (past the largest share of it)
        try:
            conversations = held_out_conversations(launch.data, args.chat_data, args.chat, workdir)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
        prompts[f"{args.chat_data} (held out)"] = [prompt_ids(target.tokenizer, c[0]["content"]) for c in conversations]
    session = Session.of(engine, workdir, runs[0].run.path(SERVED_DIR) / "speedup-benchmark")
    models = {"f32": target_gguf(engine, workdir, target), "q4_1": embedded_gguf_path(launch.target)}
    blocks, values = [], {}
    for key in args.targets:
        target_name, model = TARGET_FILES[key], models[key]
        started = time.monotonic()
        launches = Launches(session, model, key, prompts, args)

        def drafted(launches: Launches = launches) -> dict[str, dict[str, list[Completion]]]:
            jobs = [(d.label, lambda d=d: launches.serve(log_name(d), d)) for d in drafts]
            jobs += [(f"`{n}`", lambda n=n: launches.serve(n, spec_type=n)) for n in served_names.NGRAM_TYPES]
            served = {label: serve() for label, serve in (reversed(jobs) if args.reverse else jobs)}
            return {label: served[label] for label, _ in jobs}  # the table's order, whichever ran first

        rounds = [  # each round launches every server afresh
            bracketed(lambda when, launches=launches, r=r: launches.serve(f"alone-{when}-round{r}"), drafted)
            for r in range(args.rounds)
        ]
        alone = [timed.alone_speeds() for timed in rounds]
        rows = {name: row(name, [timed.drafted[name] for timed in rounds], alone) for name in rounds[0].drafted}
        pooled = recipe_rows(served, {name: found for name, (_, found) in rows.items()})
        shapes = break_evens(session, model, drafts, prompts, args)
        speeds = [[mean_speed(timed.before), mean_speed(timed.after)] for timed in rounds]
        values[key] = {"alone_tokens_per_s": speeds[0] if len(speeds) == 1 else speeds}
        values[key] |= {name.replace("`", ""): found for name, (_, found) in rows.items()}
        values[key] |= {"recipes": [found for _, found in pooled]} if pooled else {}
        values[key]["break_even"] = [found for _, found in shapes]
        columns = [
            "drafter",
            "speed-up [95%]",
            "accepted length (drafting cycles)",
            "tokens from drafts",
            "by category",
        ]
        alone_text = "; ".join(
            (f"round {r + 1}: " if len(speeds) > 1 else "")
            + f"{before:.1f} tokens/s before the drafts, {after:.1f} after"
            for r, (before, after) in enumerate(speeds)
        )
        blocks += [
            f"**{target_name} target**: alone {alone_text} ({(time.monotonic() - started) / 60:.0f} min).",
            Table(columns, [cells for cells, _ in [*rows.values(), *pooled]]),
            "\n\n".join(line for line, _ in shapes),
        ]
    count = sum(len(g) for g in prompts.values())
    values["runs"] = {t.run.name: trained_values(t) for t in runs}
    trained = "; ".join(trained_text(name, found) for name, found in values["runs"].items())
    order = "last to first" if args.reverse else "in the order listed"
    about = (
        f"{count} prompts: MT-bench first turns ({args.per_category} per category, the first by question id) and "
        f"{args.chat} of {held_out(args)}, {reply_length(args)}, T = 0. Trained on {trained}. Each speed-up is "
        "paired by prompt with the target alone, timed before and after every drafter (the mean of the two); "
        f"drafters served {order}. {noise_text(args.rounds)}"
    )
    if args.p_min:
        about += (
            " A p-min drafter's cycle drafts up to its first token below that confidence, or nothing (a plain "
            "step), so the break-even lines below, measured at p-min 0, are not its own."
        )
    title = ", ".join(f"`{t.run.name}`" for t in runs)
    return Record(title, [about, *blocks], values, Provenance.now(engine=engine.commit))


def launch_config(runs: list[tuple[str, RunConfig]], chat_data: str | None) -> RunConfig:
    """The config whose held-out chat prompts a launch serves: runs must share the target and the data up to the
    number of conversations, and the one with the most is taken, so its prompts lie past every run's share. Runs
    of different sizes need `chat_data`: one run's validation conversations may be in another's training data."""
    largest, launch = max(runs, key=lambda named: named[1].data.num_conversations)
    for name, config in runs:
        data = dataclasses.replace(config.data, num_conversations=launch.data.num_conversations)
        if (config.target, data) != (launch.target, launch.data):
            raise SystemExit(
                f"invalid --run={name!r}: trained on other data or another target than {largest!r}; allowed runs "
                "that share one target and data, up to the number of conversations"
            )
    sizes = sorted({config.data.num_conversations for _, config in runs})
    if len(sizes) > 1 and chat_data is None:
        raise SystemExit(
            f"invalid --chat-data=None for runs trained on {', '.join(map(str, sizes))} conversations: one run's "
            "held-out conversations may be another's training data; allowed a source (e.g. sharegpt), served past "
            "the largest run's share of it"
        )
    return launch


def trained_values(trained: TrainedRun) -> dict:
    """What a served run was trained as and how it validated offline: its steps, seed, how its layers started
    and its final validation's realized accepted length."""
    history = trained.state.get("history") or [{}]
    return {
        "conversations": trained.config.data.num_conversations,
        "steps": trained.config.train.max_steps,
        "seed": trained.config.train.seed,
        "draft_init": trained.config.algorithm.shared.draft_init,
        "offline_realized": history[-1].get(REALIZED_ACCEPTED_LENGTH),
    }


def trained_text(name: str, found: dict) -> str:
    """A served run, by its name and `trained_values`, as the benchmark's text states it."""
    init = ", layers from the target (`draft_init: target`)" if found["draft_init"] == "target" else ""
    offline = found["offline_realized"]
    realized = f", offline realized {offline:.3f}" if offline is not None else ""
    return (
        f"{name}: {found['conversations']} conversations, {found['steps']} steps, seed {found['seed']}{init}{realized}"
    )


def noise_text(rounds: int) -> str:
    """What a row's interval holds, as the benchmark's text states it."""
    if rounds == 1:
        return (
            "One round: each interval is over prompts within one launch per server, so launch noise is not in it; a "
            "recipe row (two or more seeds) is over seeds."
        )
    return (
        f"{rounds} rounds, each launching every server afresh (alone, drafters, alone): each drafter's interval is "
        "over its rounds' speed-ups, so launch noise is inside it; a recipe row is the mean over seeds of each "
        "seed's mean over rounds, with a t interval over seeds, so seed and launch noise are both inside it."
    )


def break_evens(session: Session, model: Path, drafts: list[ServedDraft], prompts, args) -> list[tuple[str, dict]]:
    """The break-even of each draft shape served (once per shape: synthetic acceptance times the shape, not the
    weights), on this target: its line and its values."""
    flat = [p for group in prompts.values() for p in group][: args.break_even_prompts]
    shapes, measured = [], set()
    for draft in drafts:
        if draft.shape in measured:
            continue
        measured.add(draft.shape)
        lengths = break_even.synthetic_lengths(draft.block, 5)
        found = break_even.measure(session, model, draft, flat, args.tokens, lengths)
        head = f", drafting over {draft.vocabulary} tokens" if draft.vocabulary else ""
        line = (
            f"Break-even of a block-{draft.block + 1}, {draft.layers}-layer draft (`{draft.spec_type}`{head}) on this "
            f"target: accepted length {found.text()} (cycle cost {found.cycle_cost:.2f} plain tokens)."
        )
        shape = {
            "block": draft.block + 1,
            "layers": draft.layers,
            "vocabulary": draft.vocabulary,
            "accepted_length": [found.length, found.low, found.high],
            "cycle_cost": found.cycle_cost,
        }
        shapes.append((line, shape))
    return shapes


def serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompts and lengths a served benchmark decodes, shared by the speed-up and its curve."""
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--per-category", type=int, default=3, help="MT-bench prompts per category (default: 3)")
    parser.add_argument("--chat", type=int, default=8, help="held-out chat prompts of the run (default: 8)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request (default: 128)")
    parser.add_argument("--break-even-prompts", type=int, default=8, help="prompts of the break-even (default: 8)")
    parser.add_argument(
        "--until-eos", action="store_true", help="stop each reply at its end-of-sequence token (default: decode all)"
    )


def held_out(args: argparse.Namespace) -> str:
    """Which conversations the chat prompts are, as the benchmark's text states it."""
    if args.chat_data is None:
        return "the run's held-out chat conversations"
    return (
        f"first user turns of `{args.chat_data}` in its seeded order, past the runs' largest share of it (never "
        "trained on)"
    )


def reply_length(args: argparse.Namespace) -> str:
    """How long each served reply was, as the benchmark's text states it."""
    if args.until_eos:
        return f"up to {args.tokens} new tokens or the end of the reply"
    return f"{args.tokens} new tokens each (`ignore_eos`)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(parser)
    parser.add_argument(
        "--chat-data",
        help="serve first user turns of this source as the chat prompts, past the runs' largest share of it (e.g. "
        "sharegpt for a ShareGPT-trained run; default: the run's own held-out conversations)",
    )
    parser.add_argument(
        "--run",
        required=True,
        action="append",
        help="a trained run whose draft is served (name or directory); give it again to serve several in one "
        "launch, each paired with the same alone passes (runs sharing one target and data, up to the number of "
        "conversations)",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=list(TARGET_FILES),
        default=list(TARGET_FILES),
        help="the target files served: f32 (the agreement check's) and the shipped q4_1 (default: both)",
    )
    parser.add_argument(
        "--vocabulary",
        type=int,
        nargs="*",
        default=[],
        help="also serve each draft over only this many of its training replies' most frequent tokens (a d2t map "
        "and a reduced head; e.g. 8192 16384)",
    )
    parser.add_argument(
        "--reduced-only",
        action="store_true",
        help="with --vocabulary: serve only the reduced drafts, not each run's whole-vocabulary one",
    )
    parser.add_argument(
        "--p-min",
        type=float,
        nargs="*",
        default=[],
        help="also serve each draft (and each reduced one) with llama.cpp's --spec-draft-p-min at each value: a "
        "cycle's draft ends at its first token less confident than it (e.g. 0.3 0.6)",
    )
    parser.add_argument(
        "--n-max",
        type=int,
        nargs="*",
        default=[],
        help="also serve each draft (and each reduced one) drafting at most this many tokens per cycle, llama.cpp's "
        "--spec-draft-n-max below the block: a shorter block decode and verify batch, with its own break-even "
        "(e.g. 1 2)",
    )
    parser.add_argument(
        "--cut-only",
        action="store_true",
        help="with --n-max: serve only the drafts cut to it (with and without each --p-min), not the whole block",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serve everything this many times, each round in fresh launches (alone, drafters, alone), so that "
        "launch noise is inside each interval (default: 1)",
    )
    parser.add_argument(
        "--reverse",
        action="store_true",
        help="serve the drafters in reverse order (a drift within a launch favours what runs later; two launches in "
        "opposite orders separate it from a drafter's effect)",
    )
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"invalid --rounds={args.rounds}: allowed an integer >= 1")
    if args.reduced_only and not args.vocabulary:
        raise SystemExit("invalid --reduced-only without --vocabulary: allowed with --vocabulary N")
    if args.cut_only and not args.n_max:
        raise SystemExit("invalid --cut-only without --n-max: allowed with --n-max N")
    for n in args.n_max:
        if n < 1:
            raise SystemExit(f"invalid --n-max={n}: allowed an integer >= 1, below the drafts' block")
    for cut in args.p_min:
        if not 0 < cut < 1:
            raise SystemExit(f"invalid --p-min={cut:g}: allowed a probability between 0 and 1, exclusive")
    page = Page.named(GROUP, args.page or PAGE)
    found = measure(args)
    page.publish(found)


if __name__ == "__main__":
    main()
