"""Measured acceptance: real speculative decoding on MT-bench and held-out chat prompts, logged to MLflow,
plus the agreement check between offline realized acceptance and measured greedy acceptance."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from algorithms.blocks import Anchors, sample_anchors
from algorithms.dflash import DFlashDraft
from algorithms.metrics import MetricCounts, finalize, pool, se_name
from harness import devices
from harness.config import EvalConfig
from harness.data import Document, pack_row, read_prompts
from harness.decode import DecodeStats, speculative_generate, target_greedy
from harness.features import target_features
from harness.files import atomic_write
from harness.mtbench import mtbench_questions
from harness.run import EVAL_RECORDS_FILE, Run
from harness.tracking import EVAL_PREFIX
from harness.uncertainty import mean_estimate

log = logging.getLogger(__name__)
OWN_PROMPTS = "prompts"  # the prompt set of `--prompts FILE`, decoded in MT-bench's place


def temperature_tag(temperature: float) -> str:
    """How a metric name spells its temperature: greedy, t1, t0_7."""
    return "greedy" if temperature == 0 else f"t{temperature:g}".replace(".", "_")


def prompt_ids(tokenizer, user_text: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def instruction_set(config: EvalConfig) -> str:
    """The name of the instruction prompts decoded: `mtbench`, or `prompts` for a user's own file."""
    return "mtbench" if config.prompts is None else OWN_PROMPTS


def prompt_sets(tokenizer, chat_documents: list[Document], config: EvalConfig) -> dict[str, list[list[int]]]:
    """What evaluation decodes: the instruction prompts (the first `num_prompts` MT-bench first turns, or of the
    user's own file) and as many held-out chat prompts."""
    if config.prompts is None:
        instructions = mtbench_questions(config.num_prompts)
    else:
        instructions = read_prompts(Path(config.prompts))[: config.num_prompts]
    return {
        instruction_set(config): [prompt_ids(tokenizer, text) for text in instructions],
        "chat": chat_prompt_ids(chat_documents, config.num_prompts),
    }


def chat_prompt_ids(documents: list[Document], count: int) -> list[list[int]]:
    """Held-out chat prompts: each validation document up to its first assistant token."""
    return [doc.input_ids[: doc.loss_mask.index(1)] for doc in documents[:count] if 1 in doc.loss_mask]


def summarize(runs: list[DecodeStats], prefix: str) -> dict[str, float]:
    """Per-request mean and pooled acceptance, per-slot conditional acceptance, time shares, tokens/s.

    A request that ended before its first cycle has no acceptance length: it is left out of the
    per-request mean (as Z Lab's benchmark does) and counted in `_requests_without_cycles`.
    """
    cycles = sum(len(r.acceptance_lengths) for r in runs)
    with_cycles = [r for r in runs if r.has_cycles]
    # Requests are independent prompts: the standard error of their mean (se_name) needs no clustering.
    per_request = mean_estimate([r.mean_acceptance_length for r in with_cycles])
    metrics = {
        f"{prefix}": per_request.value,
        f"{prefix}_pooled": sum(sum(r.acceptance_lengths) for r in runs) / max(1, cycles),
        f"{prefix}_requests_without_cycles": float(len(runs) - len(with_cycles)),
        # What a verification buys: committed tokens per token the target verified. A member that verifies the
        # whole block every cycle sets the baseline a confidence-scheduled (shortened) block is compared with.
        f"{prefix}_accepted_per_verified": sum(sum(r.acceptance_lengths) for r in runs)
        / max(1, sum(sum(r.verified_tokens) for r in runs)),
    }
    if math.isfinite(per_request.se):
        metrics[se_name(prefix)] = per_request.se
    slots = len(runs[0].slot_attempts)
    for slot in range(slots):
        attempts = sum(r.slot_attempts[slot] for r in runs)
        metrics[f"{prefix}_position_{slot + 1}_conditional_acc"] = (
            sum(r.slot_accepts[slot] for r in runs) / attempts if attempts else 0.0
        )
    total = sum(r.total_seconds for r in runs)
    metrics[f"{prefix}_draft_time_share"] = sum(r.draft_seconds for r in runs) / total
    metrics[f"{prefix}_verify_time_share"] = sum(r.verify_seconds for r in runs) / total
    metrics[f"{prefix}_tokens_per_s"] = sum(len(r.tokens) for r in runs) / total
    return metrics


@dataclass(frozen=True)
class OfflineReplay:
    """Offline realized accepted lengths on the target's own greedy continuations."""

    every_anchor: float  # pooled over every anchor of the continuations
    cycles: list[list[float]]  # per prompt, each replayed decoding cycle's accepted length, in order

    @property
    def replayed(self) -> float:
        """Pooled over the replayed cycles: positions weighted the way decoding visits them."""
        lengths = [tau for prompt in self.cycles for tau in prompt]
        return sum(lengths) / len(lengths) if lengths else 0.0


@torch.no_grad()
def offline_realized_on_continuations(
    target, draft: DFlashDraft, prompts: list[list[int]], continuations: list[list[int]]
) -> OfflineReplay:
    """Offline realized accepted length on the target's own greedy continuations, from one teacher-forced
    target pass per prompt, pooled over every anchor and over a replay of decoding cycles.

    The replay starts a block at the first generated position and jumps by each block's offline
    accepted length, so it weights positions the way decoding does; the all-anchor value weights
    every position once (easy stretches count more often than decoding visits them).
    """
    shared, device = draft.shared, devices.model_device(target.model)
    every_anchor: MetricCounts = {}
    cycles: list[list[float]] = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        ids = prompt + continuation
        row = pack_row([Document(ids, [0] * len(prompt) + [1] * len(continuation))], len(ids))
        anchors = sample_anchors(
            row.loss_mask, row.document_ids, shared.block_size, len(ids), devices.generator("cpu", 0)
        )
        out = target.model(input_ids=devices.ids_on(ids, device), output_hidden_states=True)
        row.features = target_features(out.hidden_states, draft.config.target_layer_ids)[0]
        row.target_hidden = out.hidden_states[-1][0]
        row, on_device = devices.to_device(row, anchors, device)
        if anchors.valid.any():
            pool(every_anchor, draft.training_forward(row, on_device).counts)
        # the first anchor is the prompt's last token position + 1 (the first generated token)
        eligible = set(anchors.positions[anchors.valid].tolist())
        position, replayed = len(prompt), []
        while position in eligible:
            single = devices.anchors_to(Anchors(torch.tensor([position]), torch.tensor([True])), device)
            tau = finalize(draft.training_forward(row, single).counts)["realized_accepted_length"]
            replayed.append(tau)
            position += int(tau)
        cycles.append(replayed)
    every = finalize(every_anchor)["realized_accepted_length"] if every_anchor else 0.0
    return OfflineReplay(every, cycles)


def evaluate(
    target, draft: DFlashDraft, chat_documents: list[Document], config: EvalConfig
) -> tuple[dict[str, float], list[dict]]:
    """Decode MT-bench (or the user's own) and held-out chat prompts greedily (lossless check included) and at
    each T > 0."""
    stop = {target.tokenizer.eos_token_id}
    metrics: dict[str, float] = {}
    records: list[dict] = []
    all_runs: dict[str, list[DecodeStats]] = {}
    generator = devices.generator(devices.model_device(target.model), config.seed)  # T > 0 samples there
    for name, prompts in prompt_sets(target.tokenizer, chat_documents, config).items():
        references = target_greedy(target.model, target.tokenizer, prompts, config.max_new_tokens, stop)
        for temperature in config.temperatures:
            tag = temperature_tag(temperature)
            runs = []
            for index, prompt in enumerate(tqdm(prompts, desc=f"decode {name} {tag}", unit="prompt")):
                stats = speculative_generate(
                    target.model,
                    draft,
                    prompt,
                    config.max_new_tokens,
                    stop,
                    temperature,
                    generator,
                    config.confidence_threshold,
                )
                runs.append(stats)
                record = {
                    "set": name,
                    "temperature": temperature,
                    "prompt": index,
                    "tokens": len(stats.tokens),
                    "cycles": len(stats.acceptance_lengths),
                    "mean_acceptance_length": stats.mean_acceptance_length if stats.has_cycles else None,
                    "histogram": {
                        str(k): stats.acceptance_lengths.count(k) for k in sorted(set(stats.acceptance_lengths))
                    },
                }
                if temperature == 0:
                    record["lossless"] = references[index] == stats.tokens
                records.append(record)
            metrics.update(summarize(runs, f"{name}_measured_accepted_length_{tag}"))
            all_runs.setdefault(tag, []).extend(runs)
            if temperature == 0:
                metrics[f"{name}_lossless_fraction"] = sum(
                    r["lossless"] for r in records if r["set"] == name and r["temperature"] == 0
                ) / len(prompts)
                # the offline metric on the very text decoding produced: a gap between the two is the procedure's,
                # not the text's (a gap between sets is the text's)
                offline = offline_realized_on_continuations(target, draft, prompts, references)
                every, replay = offline.every_anchor, offline.replayed
                measured = metrics[f"{name}_measured_accepted_length_greedy_pooled"]
                metrics[f"{name}_offline_realized_accepted_length"] = every
                metrics[f"{name}_offline_realized_accepted_length_replayed"] = replay
                metrics[f"{name}_measured_minus_offline"] = measured - every
                metrics[f"{name}_measured_offline_relative_difference"] = (
                    (measured - every) / every if every else float("nan")
                )
                metrics[f"{name}_measured_replayed_relative_difference"] = (
                    (measured - replay) / replay if replay else float("nan")
                )
    for tag, runs in all_runs.items():
        metrics.update(summarize(runs, f"measured_accepted_length_{tag}"))
    return metrics, records


def log_evaluation(run: Run, metrics: dict[str, float], records: list[dict]) -> None:
    """Log eval/* metrics and the per-request records into the run's (finished) MLflow run."""
    path = run.path(EVAL_RECORDS_FILE)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(records, indent=1)))
    run.log_into_finished(metrics, EVAL_PREFIX, [path])
