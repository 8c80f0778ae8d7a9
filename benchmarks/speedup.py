"""The served speed-up as users measure it: tokens/s with a trained draft over the target alone, in llama.cpp, on
MT-bench first turns by category and held-out chat prompts, at T = 0 and a fixed number of new tokens (or up to each
reply's end, `--until-eos`), with a 95% interval over prompts, each drafter paired with the target alone timed
before and after it; beside it, in the same run and on the same prompts, llama.cpp's training-free speculation
(the n-gram types), and the draft's break-even on this machine. With the f32 target (the agreement check's setting)
and the shipped Q4_1 target (what a user serves).

    python -m benchmarks.speedup --workdir work --run RUN      # appends to benchmarks/SPEEDUP.md

Run it on a quiet machine: it times decoding.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.budget_transfer import cpu_model
from harness import break_even
from harness.data import DataConfig, dataset_parts, load_conversations, prepare_documents
from harness.evaluate import chat_prompt_ids, prompt_ids
from harness.mtbench import mtbench_records
from harness.run import SERVED_DIR, Run, server_records
from harness.served import accepted_length, draft_gguf, served_shape
from harness.served import bracketed as bracketed_completions
from harness.serving import Completion, Engine, LlamaServer, find_engine, target_gguf
from harness.targets import embedded_gguf_path, load_target
from harness.train import checkpoint_config, restore_draft
from harness.uncertainty import ratio_estimate

OUT = Path(__file__).parent / "SPEEDUP.md"
NGRAM_TYPES = ("ngram-mod", "ngram-map-k", "ngram-cache", "ngram-simple")
CHAT = "chat (held-out)"


def prompts_by_category(tokenizer, per_category: int) -> dict[str, list[list[int]]]:
    found: dict[str, list[list[int]]] = defaultdict(list)
    for record in mtbench_records():
        if len(found[record["category"]]) < per_category:
            found[record["category"]].append(prompt_ids(tokenizer, record["turns"][0]))
    return dict(found)


def serve_all(
    server: LlamaServer, prompts: dict[str, list[list[int]]], tokens: int, ignore_eos: bool = True
) -> dict[str, list[Completion]]:
    """Each prompt's completion of `tokens` new tokens (`ignore_eos`), or up to the end-of-sequence token."""
    return {
        category: [server.complete(p, tokens, ignore_eos=ignore_eos) for p in group]
        for category, group in prompts.items()
    }


def bracketed(before: dict[str, list[Completion]], after: dict[str, list[Completion]]) -> dict[str, list[float]]:
    """Each prompt's tokens/s with the target alone: the mean of a pass before the drafts and one after."""
    return {
        category: [c.tokens_per_s for c in group] for category, group in bracketed_completions(before, after).items()
    }


def alone_speed(timed: dict[str, list[Completion]]) -> float:
    """Mean tokens/s over prompts of one alone pass."""
    return sum(c.tokens_per_s for g in timed.values() for c in g) / sum(len(g) for g in timed.values())


def row(name: str, served: dict[str, list[Completion]], alone: dict[str, list[float]]) -> list[str]:
    """Speed-up overall and per category against the bracketed alone speeds, and what the drafts did: accepted
    length over drafting cycles, and the share of generated tokens that came from accepted drafts."""
    overall = ratio_estimate(
        [c.tokens_per_s for group in served.values() for c in group], [v for group in alone.values() for v in group]
    )
    completions = [c for group in served.values() for c in group]
    cycles = [a for c in completions for a in c.accepted]
    tokens = sum(len(c.tokens) for c in completions)
    by_category = {
        category: ratio_estimate([c.tokens_per_s for c in served[category]], group) for category, group in alone.items()
    }
    per_category = " · ".join(f"{category} {found.text()}" for category, found in by_category.items())
    return [
        name,
        overall.text(),
        f"{accepted_length(cycles):.2f}" if cycles else "no drafts",
        f"{sum(c.draft_n_accepted for c in completions) / tokens:.1%}" if tokens else "-",
        per_category,
    ]


@dataclass
class ServerSetting:
    """One target model's llama-server launches in this benchmark: each serves the same prompts, alone, with the
    trained draft or with an n-gram type, and logs under its own name."""

    engine: Engine
    model: Path
    logs: Path
    tag: str
    records: Path
    prompts: dict[str, list[list[int]]]
    args: argparse.Namespace

    def serve(self, name: str, *drafter, **options) -> dict[str, list[Completion]]:
        log = self.logs / f"{self.tag}-{name}.log"
        with LlamaServer(self.engine, self.model, log, self.records, *drafter, **options) as server:
            return serve_all(server, self.prompts, self.args.tokens, not self.args.until_eos)


@dataclass
class Served:
    """One trained run as this benchmark serves it: its draft as GGUF and the shape llama.cpp drafts with."""

    run: Run
    algorithm: str
    draft_gguf: Path
    block: int
    spec_type: str

    @property
    def label(self) -> str:
        return f"`{self.run.name}` ({self.algorithm}, block {self.block + 1})"


TARGET_FILES = {"f32": "f32", "q4_1": "Q4_1 (shipped)"}


def measure(args: argparse.Namespace) -> str:
    engine = find_engine()
    runs = [Run.locate(name, args.workdir) for name in args.run]
    states = [run.load_checkpoint() for run in runs]
    configs = [checkpoint_config(state) for state in states]
    first = configs[0]
    for run, config in zip(runs[1:], configs[1:], strict=True):
        if (config.target, config.data) != (first.target, first.data):
            raise SystemExit(
                f"invalid --run={run.name!r}: trained on other data or another target than {runs[0].name!r}; "
                "allowed runs that share the first run's target and data (its held-out chat prompts are served)"
            )
    target = load_target(first.target, runs[0].workdir, first.algorithm.shared.mask_token_id)
    drafts = []
    for run, state, config in zip(runs, states, configs, strict=True):
        draft = restore_draft(state, target)
        drafts.append(
            Served(run, config.algorithm.algorithm, draft_gguf(engine, run, draft, target), *served_shape(draft))
        )
    prompts = prompts_by_category(target.tokenizer, args.per_category)
    if args.chat and args.chat_data is None:  # the first run's held-out conversations, up to their first reply
        prompts[CHAT] = chat_prompt_ids(prepare_documents(target, first.data, runs[0].workdir).validation, args.chat)
    elif args.chat:  # another source's first user turns, in its seeded order (a chitchat run's held-out ones first)
        trained_on = {source for source, _ in dataset_parts(first.data.dataset)}
        if trained_on & {source for source, _ in dataset_parts(args.chat_data)}:
            raise SystemExit(f"invalid --chat-data={args.chat_data!r}: the runs trained on it; allowed another source")
        other = DataConfig(dataset=args.chat_data, num_conversations=args.chat, num_validation=1)
        conversations, _ = load_conversations(other, runs[0].workdir)
        prompts[f"{args.chat_data} (not trained on)"] = [
            prompt_ids(target.tokenizer, c[0]["content"]) for c in conversations
        ]
    logs, records = runs[0].path(SERVED_DIR) / "speedup", server_records(runs[0].workdir)
    models = {"f32": target_gguf(engine, runs[0].workdir, target), "q4_1": embedded_gguf_path(first.target)}
    sections = []
    for key in args.targets:
        target_name, model = TARGET_FILES[key], models[key]
        started = time.monotonic()
        server = ServerSetting(engine, model, logs, key, records, prompts, args)
        before = server.serve("alone-before")
        served = {d.label: server.serve(f"draft-{d.run.name}", d.draft_gguf, d.block, d.spec_type) for d in drafts}
        served.update({f"`{ngram}`": server.serve(ngram, spec_type=ngram) for ngram in NGRAM_TYPES})
        after = server.serve("alone-after")
        alone = bracketed(before, after)
        rows = [row(name, completions, alone) for name, completions in served.items()]
        sections += [
            f"### {target_name} target: alone {alone_speed(before):.1f} tokens/s before the drafts, "
            f"{alone_speed(after):.1f} after ({(time.monotonic() - started) / 60:.0f} min)",
            "",
            "| drafter | speed-up [95%] | accepted length (drafting cycles) | tokens from drafts | by category |",
            "| --- | --- | --- | --- | --- |",
            *("| " + " | ".join(cells) + " |" for cells in rows),
            "",
            *break_evens(engine, model, drafts, prompts, logs, records, args),
            "",
        ]
    count = sum(len(g) for g in prompts.values())
    runs_text = " ".join(f"--run {name}" for name in args.run)
    trained = "; ".join(
        f"{run.name}: {config.train.max_steps} steps, seed {config.train.seed}"
        for run, config in zip(runs, configs, strict=True)
    )
    return "\n".join(
        [
            f"## {', '.join(f'`{run.name}`' for run in runs)} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"{cpu_model()} ({os.cpu_count()} cores), llama.cpp {engine.commit[:9]}; `python -m benchmarks.speedup "
            f"--workdir {args.workdir} {runs_text} --per-category {args.per_category} --chat {args.chat}"
            f"{f' --chat-data {args.chat_data}' if args.chat_data else ''} "
            f"--tokens {args.tokens}{' --until-eos' * args.until_eos} --targets {' '.join(args.targets)}`. "
            f"{count} prompts: MT-bench first turns ({args.per_category} per category, the first by question id) and "
            f"{args.chat} of {held_out(args)}, "
            f"{reply_length(args)}, T = 0. Trained on {first.data.num_conversations} conversations ({trained}). "
            "Each speed-up is paired by prompt with the target alone, timed before and after every drafter (the "
            "mean of the two).",
            "",
            *sections,
        ]
    )


def break_evens(engine, model, drafts: list[Served], prompts, logs: Path, records: Path, args) -> list[str]:
    """The break-even of each draft shape served (once per shape: synthetic acceptance times the shape, not the
    weights), on this target."""
    flat = [p for group in prompts.values() for p in group][: args.break_even_prompts]
    lines, measured = [], set()
    for draft in drafts:
        if (draft.block, draft.spec_type) in measured:
            continue
        measured.add((draft.block, draft.spec_type))
        found = break_even.measure(
            engine,
            model,
            draft.draft_gguf,
            draft.block,
            draft.spec_type,
            flat,
            args.tokens,
            logs,
            records,
            lengths=break_even.synthetic_lengths(draft.block, 5),
        )
        lines.append(
            f"Break-even of a block-{draft.block + 1} draft (`{draft.spec_type}`) on this target: accepted length "
            f"{found.text()} (cycle cost {found.cycle_cost:.2f} plain tokens)."
        )
    return lines


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
    return f"the first user turns of `{args.chat_data}` in its seeded order (not in the runs' training data)"


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
        help="serve the first user turns of this source (e.g. chitchat, for a run trained on other data) as the "
        "chat prompts (default: the run's own held-out conversations)",
    )
    parser.add_argument(
        "--run",
        required=True,
        action="append",
        help="a trained run whose draft is served (name or directory); give it again to serve several in one "
        "launch, each paired with the same alone passes (runs sharing the first one's target and data)",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=list(TARGET_FILES),
        default=list(TARGET_FILES),
        help="the target files served: f32 (the agreement check's) and the shipped q4_1 (default: both)",
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"markdown file appended to (default: {OUT})")
    args = parser.parse_args()
    section = measure(args)
    header = "" if args.out.exists() else "# Served speed-up: trained drafts beside llama.cpp's n-gram types\n\n"
    with open(args.out, "a") as out:
        out.write(header + section + "\n")
    print(section)


if __name__ == "__main__":
    main()
