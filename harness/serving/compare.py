"""Served truth: a run's draft served by llama.cpp against the harness's own decoder, on the same prompts.

Counts, not rounded means: per request, the accepted draft tokens of every verify cycle on both sides. At T = 0
both decode greedily, so every cycle in which both drafted the whole block must accept the same count; a cycle
that does not is a divergence, and its cause is named (a near-tie of the target that flipped a token, or the two
drafts proposing differently). Lossless: the served output with the draft against the same engine without it and
against the harness's greedy reference. At T > 0 the two differ by design (llama.cpp's DFlash drafts greedily and
accepts by token match; the harness samples the draft and verifies by rejection sampling): both are reported.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from algorithms.dflash import DFlashDraft
from harness import devices, tracking
from harness.config import EvalConfig
from harness.data import Document
from harness.decode import speculative_generate, target_greedy
from harness.evaluate import instruction_set, prompt_sets, temperature_tag
from harness.files import atomic_write, file_lock
from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, SERVED_RECORDS_FILE, SERVING_LOCK_FILE, Run
from harness.serving import break_even
from harness.serving import metrics as names
from harness.serving.draft import ServedDraft, check_servable, reduced_draft, served_draft, served_shape
from harness.serving.engine import Engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Completion, Session, check_prompts_fit, complete_all
from harness.serving.speed import serve_speed
from harness.serving.timing import Passes, bracketed
from harness.targets import Target
from harness.tracking import TAG_SERVED_REASON, TAG_SERVED_STATUS, RunStatus
from harness.uncertainty import mean_estimate, ratio_estimate

NEAR_TIE = 0.05  # a top-2 logit gap below this counts as a near-tie: the verify batch's rounding may flip it


@dataclass
class Divergence:
    cycle: int  # the first compared cycle whose accepted count differs
    harness_accepted: int
    served_accepted: int
    cause: str


def compare_cycles(
    harness_accepted: list[int], harness_drafted: list[int], served: Completion, block: int
) -> tuple[int, int, Divergence | None]:
    """(cycles compared, cycles identical, the first divergence). Only cycles in which both sides drafted the
    whole block are compared: near the token budget each engine shortens its last drafts its own way."""
    compared = identical = 0
    divergence = None
    pairs = zip(harness_accepted, harness_drafted, served.accepted, served.drafted, strict=False)
    for cycle, (ours, our_drafts, theirs, their_drafts) in enumerate(pairs):
        if our_drafts != block or their_drafts != block:
            break
        compared += 1
        if ours == theirs:
            identical += 1
        elif divergence is None:
            divergence = Divergence(cycle, ours, theirs, "")
        if divergence is not None:  # after a divergence the two continue from different states
            break
    return compared, identical, divergence


@torch.no_grad()
def top2_gap(target: Target, prefix: list[int]) -> float:
    """The target's top-2 logit gap for the token after `prefix` (fp32, the harness's own forward)."""
    logits = target.model(input_ids=torch.tensor([prefix]).to(target.model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def cause_of(target: Target, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """Why two greedy decodings parted: a token flip (with the target's gap there), or the drafts alone."""
    at = first_difference(ours, theirs)
    if at is None or at >= min(len(ours), len(theirs)):
        return "same tokens: the two drafts proposed differently"
    gap = top2_gap(target, prompt + ours[:at])
    kind = "near-tie" if gap < NEAR_TIE else "not a near-tie"
    return f"token {at} flipped ({ours[at]} here, {theirs[at]} served): target top-2 gap {gap:.5f}, {kind}"


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean over requests and its standard error, as `evaluate` takes a measured accepted length's."""
    estimate = mean_estimate(values)
    return estimate.value, estimate.se


def accepted_length(accepted: list[int]) -> float:
    """Mean tokens per verify cycle, the verified token included: 1 + accepted drafts / cycles."""
    return 1 + sum(accepted) / len(accepted) if accepted else float("nan")


Served = Passes  # (prompt set, temperature) -> one completion per prompt


@contextmanager
def serving(run: Run) -> Iterator[None]:
    """One process at a time serves a run (its export, GGUF and server logs are the holder's; a second evaluation
    waits), and MLflow says how the serving went: `running` while it serves, `finished` with the metrics
    (log_served), `interrupted` or `failed` with the reason when it stops early. Only a SIGKILL leaves `running`
    behind, and the next serving of the run replaces it."""
    with file_lock(run.path(SERVED_DIR) / SERVING_LOCK_FILE, f"serving run {run.name}"):
        run.log_into_finished({}, "", [], tags=serving_tags(RunStatus.RUNNING))
        try:
            yield
        except KeyboardInterrupt as stop:
            run.log_into_finished(
                {}, "", [], tags=serving_tags(RunStatus.INTERRUPTED, str(stop) or "interrupted (Ctrl-C)")
            )
            raise
        except Exception as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            run.log_into_finished({}, "", [], tags=serving_tags(RunStatus.FAILED, reason))
            raise


def serving_tags(status: RunStatus, reason: str = "") -> dict[str, str]:
    """How a run's latest serving went, as its tags."""
    return {TAG_SERVED_STATUS: status.value, TAG_SERVED_REASON: reason}


def served_status(run: Run) -> RunStatus | None:
    """How the run's latest serving went, None if it was never served."""
    status = run.tags().get(TAG_SERVED_STATUS)
    return RunStatus(status) if status else None


def serve_run(
    engine: Engine, run: Run, target: Target, draft: DFlashDraft, chat_documents, config: EvalConfig
) -> dict[str, float]:
    """Serve, compare and log one run's draft (the step behind `evaluate --engine` and a study's serving)."""
    with serving(run):
        metrics, records = serve_and_compare(engine, run, target, draft, chat_documents, config)
        log_served(run, engine, metrics, records)
    return metrics


def serve_speed_run(
    engine: Engine,
    run: Run,
    target: Target,
    draft: DFlashDraft,
    chat_documents,
    config: EvalConfig,
    replies: Sequence[Document] = (),
) -> dict[str, float]:
    """Serve one run's draft for its speed alone (speed.py: rounds of fresh launches, no harness decode) and log
    it: what a study's served objective costs per trial. With `config.served_vocabulary` the draft proposes from the
    tokens its training `replies` use most; with `config.served_confidence_cut` its cycles end at an unconfident
    token; with `config.served_draft_length` they draft at most that many tokens."""
    check_servable(draft)
    sets = prompt_sets(target.tokenizer, chat_documents, config)
    check_prompts_fit(sets, config.max_new_tokens)
    with serving(run):
        session = Session.of(engine, run.workdir, run.path(SERVED_DIR))
        model = target_gguf(engine, run.workdir, target)
        served_as = served_draft(engine, run, draft, target)
        if config.served_vocabulary is not None:
            served_as = reduced_draft(engine, run, served_as, target, replies, config.served_vocabulary)
        served_as = dataclasses.replace(
            served_as,
            confidence_cut=config.served_confidence_cut,
            block=min(served_as.block, config.served_draft_length or served_as.block),  # a swept smaller block wins
        )
        speed = serve_speed(session, model, served_as, sets, config.max_new_tokens, config.served_rounds)
        metrics = speed.metrics() | {
            names.VOCABULARY: config.served_vocabulary or target.spec.vocab_size,
            names.CONFIDENCE_CUT: config.served_confidence_cut,
            names.DRAFT_LENGTH: served_as.block,
        }
        log_served(run, engine, metrics, speed.records())
    return metrics


def serve_and_compare(
    engine: Engine, run: Run, target: Target, draft: DFlashDraft, chat_documents, config: EvalConfig
) -> tuple[dict[str, float], list[dict]]:
    """Serve the run's draft and the target alone; decode the same prompts with the harness; compare."""
    check_servable(draft)
    sets = prompt_sets(target.tokenizer, chat_documents, config)
    check_prompts_fit(sets, config.max_new_tokens)
    temperatures = sorted({0.0, *config.temperatures})  # T = 0 always: the cycle-by-cycle check needs it
    session = Session.of(engine, run.workdir, run.path(SERVED_DIR))
    model = target_gguf(engine, run.workdir, target)  # checked once: each check reads the whole target GGUF
    served_as = served_draft(engine, run, draft, target)
    served, peers, alone = serve_prompts(session, model, served_as, sets, temperatures, config)
    records = [
        record
        for name, prompts in sets.items()
        for record in compare_requests(target, draft, name, prompts, served, alone, config.max_new_tokens)
    ]
    metrics = served_metrics(served, alone, records) | peer_metrics(peers, alone)
    for temperature in temperatures[1:]:
        metrics.update(harness_sampled(target, draft, sets, temperature, config))
    found = break_even.measure(session, model, served_as, sets[instruction_set(config)], config.max_new_tokens)
    metrics.update(found.metrics())
    metrics[names.BREAK_EVEN_SHORTFALL] = metrics[names.BREAK_EVEN] - metrics[names.ACCEPTED_GREEDY]
    return metrics, records


def harness_sampled(target: Target, draft: DFlashDraft, prompt_sets: dict, temperature: float, config) -> dict:
    """The harness's own decoder at T > 0 on the served prompts, to stand beside the served number: the two differ
    by design (docs/metrics.md), so neither is forced to the other."""
    stop = {target.tokenizer.eos_token_id}
    generator = devices.generator(devices.model_device(target.model), config.seed)
    tag = temperature_tag(temperature)
    lengths = []
    for name, prompts in prompt_sets.items():
        for prompt in tqdm(prompts, desc=f"decode {name} {tag} in the harness", unit="request"):
            stats = speculative_generate(
                target.model, draft, prompt, config.max_new_tokens, stop, temperature, generator
            )
            lengths.append(stats.mean_acceptance_length)
    value, se = mean_and_se(lengths)
    return {f"harness_accepted_length_{tag}": value, f"harness_accepted_length_{tag}_se": se}


def serve_prompts(
    session: Session, model: Path, draft: ServedDraft, prompt_sets: dict, temperatures: list, config
) -> tuple[Served, dict[str, Served], Served]:
    """Every prompt through the target alone, then with the draft at each temperature and (`ngram_peers`) with each
    n-gram type at T = 0, then alone again: the alone speeds are bracketed."""
    tokens = config.max_new_tokens

    def alone_pass(when: str) -> Served:
        with session.server(model, f"server-alone-{when}") as server:
            return {
                (name, 0.0): [
                    server.complete(p, tokens)
                    for p in tqdm(prompts, desc=f"serve {name} without the draft ({when})", unit="request")
                ]
                for name, prompts in prompt_sets.items()
            }

    def with_draft() -> tuple[Served, dict[str, Served]]:
        served: Served = {}
        with session.server(model, "server-draft", draft) as server:
            for (name, prompts), temperature in itertools.product(prompt_sets.items(), temperatures):
                bar = tqdm(prompts, desc=f"serve {name} {temperature_tag(temperature)}", unit="request")
                served[name, temperature] = [
                    server.complete(p, tokens, temperature, config.seed + i) for i, p in enumerate(bar)
                ]
        peers = {}
        kinds = names.NGRAM_TYPES if config.ngram_peers else ()
        for kind in kinds:  # the training-free peers, on the same prompts between the same alone passes
            with session.server(model, f"server-{kind}", spec_type=kind) as server:
                found = complete_all(server, prompt_sets, tokens, desc=f"serve {kind}")
            peers[kind] = {(name, 0.0): completions for name, completions in found.items()}
        return served, peers

    timed = bracketed(alone_pass, with_draft)
    served, peers = timed.drafted
    return served, peers, timed.alone


def compare_requests(
    target: Target, draft: DFlashDraft, name: str, prompts: list, served: Served, alone: Served, tokens: int
) -> list[dict]:
    """Per request at T = 0: the harness's decoder against the served cycles, and the served tokens against the
    engine alone and the harness's greedy reference."""
    stop = {target.tokenizer.eos_token_id}
    block = served_shape(draft)[0]
    references = target_greedy(target.model, target.tokenizer, prompts, tokens, stop)
    records = []
    for index, prompt in enumerate(tqdm(prompts, desc=f"decode {name} in the harness", unit="request")):
        ours = speculative_generate(target.model, draft, prompt, tokens, stop)
        theirs, engine_alone = served[name, 0.0][index], alone[name, 0.0][index]
        our_accepted = [tau - 1 for tau in ours.acceptance_lengths]
        our_drafted = [verified - 1 for verified in ours.verified_tokens]
        compared, identical, divergence = compare_cycles(our_accepted, our_drafted, theirs, block)
        if divergence is not None:
            divergence.cause = cause_of(target, prompt, ours.tokens, theirs.tokens)
        flip_harness = theirs.tokens != references[index]
        records.append(
            {
                "set": name,
                "prompt": index,
                "harness_accepted": our_accepted,
                "served_accepted": theirs.accepted,
                "served_drafted": theirs.drafted,
                "cycles_compared": compared,
                "cycles_identical": identical,
                "divergence": asdict(divergence) if divergence else None,
                "served_tokens_differ_from_engine_alone": theirs.tokens != engine_alone.tokens,
                "served_tokens_differ_from_harness_reference": flip_harness,
                **({"flip": cause_of(target, prompt, references[index], theirs.tokens)} if flip_harness else {}),
                "served_draft_n": theirs.draft_n,
                "served_draft_n_accepted": theirs.draft_n_accepted,
                "served_tokens_per_s": theirs.tokens_per_s,
                "alone_tokens_per_s": engine_alone.tokens_per_s,
            }
        )
    return records


def served_metrics(served: Served, alone: Served, records: list[dict]) -> dict[str, float]:
    """Served accepted lengths (per set and overall, per temperature) with their counts, agreement, flips, speed."""
    nan = float("nan")
    metrics: dict[str, float] = {}
    by_tag: dict[str, list[float]] = {}
    for (name, temperature), completions in served.items():
        tag = temperature_tag(temperature)
        lengths = [accepted_length(c.accepted) for c in completions]
        by_tag.setdefault(tag, []).extend(lengths)
        metrics[f"{name}_accepted_length_{tag}"], metrics[f"{name}_accepted_length_{tag}_se"] = mean_and_se(lengths)
        metrics[f"{name}_cycles_{tag}"] = sum(len(c.accepted) for c in completions)
        metrics[f"{name}_accepted_tokens_{tag}"] = sum(sum(c.accepted) for c in completions)
    for tag, lengths in by_tag.items():
        metrics[f"accepted_length_{tag}"], metrics[f"accepted_length_{tag}_se"] = mean_and_se(lengths)
    greedy = [key for key in served if key[1] == 0]
    with_draft = [c.tokens_per_s for key in greedy for c in served[key]]
    without = [c.tokens_per_s for key in greedy for c in alone[key]]
    metrics[names.TOKENS_PER_S_DRAFT], metrics[names.TOKENS_PER_S_ALONE] = (
        statistics.fmean(with_draft),
        statistics.fmean(without),
    )
    # The mean speed with the draft over the mean without, paired by request: its interval is over requests.
    speedup = ratio_estimate(with_draft, without)
    metrics |= {
        names.SPEEDUP: speedup.value,
        names.se(names.SPEEDUP): speedup.se,
        names.low(names.SPEEDUP): speedup.low,
        names.high(names.SPEEDUP): speedup.high,
        names.ROUNDS: 1,  # one launch with the draft: its interval holds no launch noise (speed.py's rounds do)
    }
    compared = sum(r["cycles_compared"] for r in records)
    metrics[names.CYCLES_COMPARED] = compared
    metrics[names.AGREEMENT_CYCLES] = sum(r["cycles_identical"] for r in records) / compared if compared else nan
    agreeing = sum(r["divergence"] is None for r in records)
    metrics[names.AGREEMENT_REQUESTS] = agreeing / len(records) if records else nan
    metrics[names.FLIPS_VS_ENGINE] = sum(r["served_tokens_differ_from_engine_alone"] for r in records)
    metrics[names.FLIPS_VS_HARNESS] = sum(r["served_tokens_differ_from_harness_reference"] for r in records)
    return metrics


def peer_metrics(peers: dict[str, Served], alone: Served) -> dict[str, float]:
    """Each n-gram type's speed-up over the same bracketed alone speeds as the draft's, paired by request."""
    metrics = {}
    for kind, served in peers.items():
        with_peer = [c.tokens_per_s for key in served for c in served[key]]
        without = [c.tokens_per_s for key in served for c in alone[key]]
        speedup = ratio_estimate(with_peer, without)
        metrics[names.ngram_speedup(kind)], metrics[names.se(names.ngram_speedup(kind))] = speedup.value, speedup.se
    return metrics


def log_served(run: Run, engine: Engine, metrics: dict[str, float], records: list[dict]) -> None:
    """served/llama_cpp/* metrics, the per-request records and the GGUF draft that was served (artifacts), and the
    engine's commit and converter as tags, with the serving's status `finished` in the same batch."""
    path = run.path(SERVED_RECORDS_FILE)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(records, indent=1)))
    tags = {
        tracking.TAG_ENGINE_COMMIT: engine.commit,
        tracking.TAG_GGUF_VERSION: engine.converter_version,
        **serving_tags(RunStatus.FINISHED),
    }
    run.log_into_finished(metrics, names.PREFIX, [path, run.path(SERVED_DIR) / DRAFT_GGUF_FILE], tags=tags)
