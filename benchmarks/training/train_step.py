"""Training-step speed and memory, side by side with speculators 0.9.0 on identical shapes, knobs, weights and batch.

    python -m benchmarks.training.train_step --sizes tiny medium --algorithms dflash dflash2 --precisions fp32 bf16
    python -m benchmarks.training.train_step --nproc-per-node 2 --sizes medium --algorithms dflash2   # SCALING.md

Prints one JSON line per measurement and records it in benchmarks/training/TRAIN_STEP.md. Losses must agree within
1e-3 relative before anything is timed. Steps are forward + backward + grad clipping, interleaved
A B A B, both sides under the same precision (fp32, or bf16 autocast with fp32 master weights as
the reference recipe trains); peak memory is measured in a fresh process per implementation (RSS on CPU,
max_memory_allocated on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from algorithms import AlgorithmConfig, TargetSpec, build_draft
from algorithms.blocks import PackedRow, block_attention_mask, sample_anchors
from algorithms.modeling import RMSNorm
from benchmarks.common.peers import fixed_anchors, speculators_draft, speculators_inputs, speculators_train_kwargs
from benchmarks.common.records import Page, Provenance, Record, Table
from harness import devices
from harness.devices import autocast, synchronize  # the training loop's precision, applied to both sides
from harness.distributed import exit_rank_after, joined, run_ranks, shard


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_layers: int
    anchors: int
    block: int
    tokens: int
    target_layers: int = 28
    cuda_only: bool = False


GROUP = "training"
SIZES = {
    "tiny": Size(256, 4, 2, 64, 768, 2048, 2, 32, 8, 512),
    "medium": Size(1024, 16, 8, 64, 3072, 32000, 1, 128, 8, 1024),
    "smollm": Size(576, 9, 3, 64, 1536, 49152, 5, 64, 8, 1024, target_layers=30),
    "qwen3-8b": Size(4096, 32, 8, 128, 12288, 151936, 5, 512, 8, 8192, target_layers=36, cuda_only=True),
}


@dataclass(frozen=True)
class TheirConfiguration:
    """How speculators runs: attention backend, loss implementation and whether its torch.compile is on.

    speculators wraps its step in torch.compile only when CUDA is available; `compile=False` runs
    those functions eagerly (torch.compiler stance force_eager).
    """

    attention: str
    losses: str
    compile: bool
    why: str

    def context(self):
        return contextlib.nullcontext() if self.compile else torch.compiler.set_stance("force_eager")


def their_configurations(device: str) -> list[TheirConfiguration]:
    """Their configurations to try, best first; the first whose step runs is the one measured."""
    if device.startswith("cuda"):
        return [
            TheirConfiguration(
                "simple_flex_attention",
                "fused",
                True,
                "their default: flex attention, fused Triton losses, torch.compile",
            ),
            TheirConfiguration(
                "sdpa",
                "fused",
                False,
                "fallback: sdpa, fused losses, no compile (their compiled default failed, see below)",
            ),
        ]
    return [
        TheirConfiguration(
            "sdpa", "eager", False, "CPU: sdpa and eager losses, the only ones that run without CUDA; no torch.compile"
        )
    ]


def build(size: Size, algorithm: str, device: str, seed: int = 0, theirs_config: TheirConfiguration | None = None):
    """Ours and theirs with identical weights, plus one packed row and its anchors."""
    ours, row, raw_last, anchors = build_ours(size, algorithm, device, seed)
    theirs_config = theirs_config or their_configurations(device)[0]
    theirs = speculators_draft(ours.cpu(), theirs_config.attention).to(device)
    ours.to(device)
    row, anchors = row.to(device), type(anchors)(anchors.positions.to(device), anchors.valid.to(device))
    return ours, theirs, row, raw_last.to(device), anchors


def build_ours(size: Size, algorithm: str, device: str, seed: int = 0):
    """Our draft on `device`, and one packed row, its raw last hidden state and its anchors on the host."""
    torch.manual_seed(seed)
    target = TargetSpec(
        num_hidden_layers=size.target_layers,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        intermediate_size=size.intermediate,
        vocab_size=size.vocab,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    knobs = dict(
        block_size=size.block,
        num_draft_layers=size.draft_layers,
        max_anchors=size.anchors,
        mask_token_id=5,
        loss="kl_div",
        position_weighting="fixed-exp-decay",
        block_attention="bidirectional",
        candidate_top_k=16,
    )
    if algorithm == "dflash2":
        knobs.update(selector_init="normal")
    embed = torch.randn(size.vocab, size.hidden) * 0.02
    head = torch.randn(size.vocab, size.hidden) * 0.02
    ours = build_draft(AlgorithmConfig.preset(algorithm, **knobs), target, embed, head).to(device)

    generator = devices.generator("cpu", seed)
    length, docs = size.tokens, 4
    document_ids = torch.arange(length) * docs // length
    starts = torch.searchsorted(document_ids, torch.arange(docs))
    position_ids = torch.arange(length) - starts[document_ids]
    loss_mask = (position_ids >= 16).float()
    raw_last = torch.randn(length, size.hidden, generator=generator)
    norm = RMSNorm(size.hidden, 1e-6)
    with torch.no_grad():
        row = PackedRow(
            torch.randint(0, size.vocab, (length,), generator=generator),
            loss_mask,
            document_ids,
            position_ids,
            torch.randn(length, len(ours.config.target_layer_ids) * size.hidden, generator=generator),
            norm(raw_last),
        )
    anchors = sample_anchors(row.loss_mask, row.document_ids, size.block, size.anchors, generator)
    return ours, row, raw_last, anchors


def steppers(
    ours, theirs, row, raw_last, anchors, precision: str = "fp32", theirs_config: TheirConfiguration | None = None
):
    device = str(row.input_ids.device)
    theirs_config = theirs_config or their_configurations(device)[0]
    inputs, kwargs = speculators_inputs(row, raw_last), speculators_train_kwargs(ours, theirs_config.losses)
    ours_params = [p for p in ours.parameters() if p.requires_grad]
    theirs_params = [p for p in theirs.parameters() if p.requires_grad]

    def ours_step() -> float:
        with autocast(device, precision):
            loss = ours.training_forward(row, anchors).loss
        ours.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours_params, 1.0)
        return float(loss.detach())

    def theirs_step() -> float:
        with fixed_anchors(anchors), autocast(device, precision), theirs_config.context():
            _, loss, _ = theirs(**inputs, **kwargs)
        theirs.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs_params, 1.0)
        return float(loss.detach())

    return ours_step, theirs_step


def timed(step, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - started


def current_rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def memory_probe(
    size_name: str, algorithm: str, which: str, device: str, precision: str, config_index: int, steps: int = 3
) -> float:
    """Peak memory growth (MiB) over a few steps of one implementation, the other one freed first."""
    config = their_configurations(device)[config_index]
    ours, theirs, row, raw_last, anchors = build(SIZES[size_name], algorithm, device, theirs_config=config)
    ours_step, theirs_step = steppers(ours, theirs, row, raw_last, anchors, precision, config)
    if which == "ours":
        step = ours_step
        del theirs_step, theirs
    else:
        step = theirs_step
        del ours_step, ours
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(steps):
            step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base, peak, running = current_rss_mib(), [0.0], [True]

    def sample() -> None:  # RSS sampled every 2 ms: ru_maxrss would include the construction peak
        while running[0]:
            peak[0] = max(peak[0], current_rss_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(steps):
        step()
    running[0] = False
    sampler.join()
    return peak[0] - base


def probe_in_subprocess(size: str, algorithm: str, which: str, device: str, precision: str, config_index: int) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.training.train_step",
            "--probe",
            which,
            "--sizes",
            size,
            "--algorithms",
            algorithm,
            "--device",
            device,
            "--precisions",
            precision,
            "--theirs-config",
            str(config_index),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


# Dense bf16 peak FLOP/s for MFU, by device name.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12}


def model_flops(ours, row: PackedRow, anchors) -> float:
    """Model FLOPs of one training step, the same for both implementations.

    6 x params x rows for every trainable matmul (fc over the T context rows, k/v over T + M, the rest
    over the M block rows), the frozen head's forward and input gradient over M rows plus the verifier
    head's forward over M rows, and attention over the allowed (query, key) pairs: 4 x heads x head_dim
    per pair forward, x3 with backward.
    """
    config, target = ours.config, ours.config.target
    length, queries = row.length, anchors.positions.shape[0] * config.block_size
    flops = 0.0
    for name, module in ours.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.requires_grad:
            rows = length if name == "fc" else length + queries if name.endswith(("k_proj", "v_proj")) else queries
            flops += 6 * module.weight.numel() * rows
    flops += 6 * target.vocab_size * target.hidden_size * queries
    allowed = int(
        block_attention_mask(
            anchors, row.document_ids, config.block_size, config.causal_blocks, config.sliding_window
        ).sum()
    )
    flops += config.num_layers * 12 * target.num_attention_heads * target.head_dim * allowed
    return flops


def bf16_peak(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


def measure(size_name: str, algorithm: str, device: str, precision: str, steps: int, warmup: int) -> dict:
    record = {
        "size": size_name,
        "algorithm": algorithm,
        "device": device,
        "precision": precision,
        "theirs_failures": [],
    }
    for config_index, config in enumerate(their_configurations(device)):  # noqa: B007 - the index that ran is used below
        ours, theirs, row, raw_last, anchors = build(SIZES[size_name], algorithm, device, theirs_config=config)
        ours_step, theirs_step = steppers(ours, theirs, row, raw_last, anchors, precision, config)
        try:
            theirs_loss = theirs_step()
            break
        except Exception as error:  # their compiled default is known to crash; record why and fall back
            record["theirs_failures"].append(
                f"{config.attention}/{config.losses}: {type(error).__name__}: {str(error)[:300]}"
            )
            del ours, theirs
    else:
        record["error"] = "no speculators configuration ran"
        return record
    record["theirs_configuration"] = (
        f"{config.attention}, {config.losses} losses, {'compiled' if config.compile else 'eager'} ({config.why})"
    )
    ours_loss = ours_step()
    relative = abs(ours_loss - theirs_loss) / abs(theirs_loss)
    record.update({"ours_loss": ours_loss, "theirs_loss": theirs_loss, "loss_relative_difference": relative})
    if relative > 1e-3:
        record["error"] = "losses disagree by more than 1e-3 relative: refusing to time"
        return record
    for _ in range(warmup):
        ours_step(), theirs_step()
    ours_times, theirs_times = [], []
    for _ in range(steps):  # interleaved A B A B, so drift on a noisy machine hits both alike
        ours_times.append(timed(ours_step, device))
        theirs_times.append(timed(theirs_step, device))
    ratios = [a / b for a, b in zip(ours_times, theirs_times, strict=True)]
    flops, queries = model_flops(ours, row, anchors), anchors.positions.shape[0] * ours.config.block_size
    del ours, theirs
    ours_mem = probe_in_subprocess(size_name, algorithm, "ours", device, precision, config_index)
    theirs_mem = probe_in_subprocess(size_name, algorithm, "theirs", device, precision, config_index)
    ours_median, theirs_median = statistics.median(ours_times), statistics.median(theirs_times)
    peak = bf16_peak(device) if precision == "bf16" else None
    record.update(
        {
            "steps": steps,
            "ours_median_ms": 1000 * ours_median,
            "ours_min_ms": 1000 * min(ours_times),
            "theirs_median_ms": 1000 * theirs_median,
            "theirs_min_ms": 1000 * min(theirs_times),
            "time_ratio_median": statistics.median(ratios),
            "time_ratio_min": min(ratios),
            "ours_peak_mib": ours_mem,
            "theirs_peak_mib": theirs_mem,
            "memory_ratio": ours_mem / theirs_mem if theirs_mem else float("nan"),
            "model_gflop_per_step": flops / 1e9,
            "ours_query_tokens_per_s": queries / ours_median,
            "theirs_query_tokens_per_s": queries / theirs_median,
            "ours_model_tflops": flops / ours_median / 1e12,
            "theirs_model_tflops": flops / theirs_median / 1e12,
            "ours_mfu": flops / ours_median / peak if peak else None,
            "theirs_mfu": flops / theirs_median / peak if peak else None,
        }
    )
    return record


# Issue goals: (size, algorithm, device kind) -> (max time ratio, max memory ratio).
GOALS = {("medium", "dflash2", "cpu"): (0.5, 0.6), ("qwen3-8b", "dflash2", "cuda"): (1 / 1.5, 0.6)}


def goal_lines(records: list[dict]) -> list[str]:
    lines = []
    for (size, algorithm, kind), (max_time, max_memory) in GOALS.items():
        rows = [
            r
            for r in records
            if (r["size"], r["algorithm"]) == (size, algorithm) and r["device"].startswith(kind) and "error" not in r
        ]
        if not rows:
            lines.append(f"- {size} {algorithm} on {kind}: not measured in this run.")
        for r in rows:
            met = r["time_ratio_median"] <= max_time and r["memory_ratio"] <= max_memory
            lines.append(
                f"- {size} {algorithm} on {kind}, {r['precision']}: time ratio "
                f"{r['time_ratio_median']:.3f} (goal <= {max_time:.3g}), "
                f"memory ratio {r['memory_ratio']:.3f} (goal <= {max_memory}): {'met' if met else 'NOT met'}."
            )
    return lines


def results_record(records: list[dict]) -> Record:
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("transformers", "speculators")}
    where = f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU only"
    about = "\n".join(
        [
            f"- {torch.get_num_threads()} threads, {where}; {', '.join(f'{k} {v}' for k, v in versions.items())}.",
            "- Step = forward + backward + grad clipping on the same flattened batch; interleaved A B; ratio = ours / "
            "theirs per pair, median.",
            "- Precision: both sides run the same one: fp32, or bf16 autocast with fp32 master weights.",
            "- Peak memory: RSS growth over the steps (CPU) or max_memory_allocated (CUDA), each in a fresh process.",
            "- Model TFLOP/s counts the same FLOPs for both (see `model_flops`); MFU is against the dense bf16 peak, "
            "CUDA only.",
        ]
    )
    columns = [
        "size",
        "algorithm",
        "device",
        "precision",
        "speculators configuration",
        "loss rel. diff",
        "ours median ms",
        "theirs median ms",
        "time ratio",
        "ours peak MiB",
        "theirs peak MiB",
        "memory ratio",
        "ours query tok/s",
        "ours model TFLOP/s (MFU)",
    ]
    rows = []
    for r in records:
        head = [r["size"], r["algorithm"], r["device"], r["precision"], str(r.get("theirs_configuration", "-"))]
        if "error" in r:
            rows.append([*head, f"{r.get('loss_relative_difference', float('nan')):.2e}", r["error"], *[""] * 7])
            continue
        mfu = f" ({100 * r['ours_mfu']:.1f}%)" if r["ours_mfu"] else ""
        rows.append(
            [
                *head,
                f"{r['loss_relative_difference']:.2e}",
                f"{r['ours_median_ms']:.1f}",
                f"{r['theirs_median_ms']:.1f}",
                f"{r['time_ratio_median']:.3f}",
                f"{r['ours_peak_mib']:.0f}",
                f"{r['theirs_peak_mib']:.0f}",
                f"{r['memory_ratio']:.3f}",
                f"{r['ours_query_tokens_per_s']:.0f}",
                f"{r['ours_model_tflops']:.3f}{mfu}",
            ]
        )
    failures = [
        f"- {r['size']} {r['algorithm']} {r['precision']}: {failure}"
        for r in records
        for failure in r.get("theirs_failures", [])
    ]
    blocks = [about, Table(columns, rows), "**Goals**", "\n".join(goal_lines(records))]
    if failures:
        blocks += ["**speculators configurations that failed**", "\n".join(failures)]
    sizes = ", ".join(dict.fromkeys(r["size"] for r in records))
    return Record(f"{sizes} on {where}", blocks, {"records": records}, Provenance.now())


def rank_throughput(
    size_name: str, algorithm: str, device: str, precision: str, steps: int, warmup: int, output: Path
) -> None:
    """One rank of a scaling leg (run under torchrun): the training loop's data-parallel step (this rank's anchors,
    FSDP2-sharded draft, optimizer step) on one fixed global batch; rank 0 writes the global query tokens/s."""
    from harness.train import optimizer_step, rank_part

    with joined(device) as (ranks, device):
        ours, row, _, anchors = build_ours(SIZES[size_name], algorithm, device)
        part, share = rank_part(ours, row, anchors, ranks)
        draft = shard(ours, ranks, devices.uses_bf16(device, precision))
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
        row_here, part_here = devices.to_device(row, part, device)

        def step() -> None:
            with autocast(device, precision):
                loss = draft.training_forward(row_here, part_here).loss
            optimizer_step(draft, optimizer, loss, share, ranks, 1.0)

        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            ranks.barrier()
            times.append(timed(step, device))
        seconds = max(ranks.gather(statistics.median(times)))  # the slowest rank sets the pace
    if ranks.is_main:
        tokens = int(anchors.valid.sum()) * SIZES[size_name].block
        leg = {"ranks": ranks.world_size, "threads_per_rank": torch.get_num_threads(), "step_s": seconds}
        output.write_text(json.dumps({**leg, "query_tokens_per_s": tokens / seconds}))


def scaling(
    size_name: str, algorithm: str, device: str, precision: str, nproc: int, steps: int, warmup: int, repeats: int = 2
) -> dict:
    """Global query tokens/s of `nproc` ranks against 1 rank on one batch, the legs alternating 1, N, 1, N so
    that drift on a shared machine hits both. On the CPU the ranks share the cores (equal total threads) and the
    efficiency is the ratio of the throughputs; on GPUs each rank has its own device and it is that ratio / N."""
    import os

    legs: dict[int, list[dict]] = {1: [], nproc: []}
    for ranks in [1, nproc] * repeats:
        output = Path(os.environ.get("TMPDIR", "/tmp")) / f"scaling-{os.getpid()}-{ranks}.json"
        args = ["--rank-throughput", "--sizes", size_name, "--algorithms", algorithm, "--device", device]
        args += ["--precisions", precision, "--steps", str(steps), "--warmup", str(warmup)]
        ended = run_ranks(ranks, "benchmarks.training.train_step", [*args, "--rank-output", str(output)], output.parent)
        if ended.status != 0:
            why = ended.lost or f"exit status {ended.status}"
            return {"size": size_name, "algorithm": algorithm, "error": f"the {ranks}-rank leg failed: {why}"}
        legs[ranks].append(json.loads(output.read_text()))
        output.unlink()
    best = {ranks: max(leg["query_tokens_per_s"] for leg in runs) for ranks, runs in legs.items()}
    per_device = torch.device(device).type == "cuda"
    return {
        "size": size_name,
        "algorithm": algorithm,
        "device": device,
        "precision": precision,
        "nproc_per_node": nproc,
        "total_threads": legs[1][0]["threads_per_rank"],
        "threads_per_rank": legs[nproc][0]["threads_per_rank"],
        "one_rank_tokens_per_s": best[1],
        "ranks_tokens_per_s": best[nproc],
        "efficiency": best[nproc] / best[1] / (nproc if per_device else 1),
        "efficiency_is": "per device (N GPUs against 1)" if per_device else "at equal total threads",
        "legs": legs,
    }


def scaling_record(records: list[dict]) -> Record:
    about = (
        "Step = the training loop's data-parallel step: each rank's every-N-th anchor of one fixed global batch, "
        "forward + backward (gradients reduced by FSDP2) + clipping + AdamW. Legs alternate 1, N, 1, N ranks; the "
        "best of each is kept. Efficiency on the CPU = global query tokens/s of N ranks / that of 1 rank with the "
        "same total threads; on GPUs = that ratio / N (each rank has its own GPU). 1.0: no loss from splitting; each "
        "rank also recomputes the row's shared context projections."
    )
    columns = [
        "size",
        "algorithm",
        "device",
        "precision",
        "ranks",
        "threads per rank",
        "1-rank tok/s",
        "N-rank tok/s",
        "efficiency",
    ]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["size"], r["algorithm"], "", "", "", "", r["error"], "", ""])
            continue
        rows.append(
            [
                r["size"],
                r["algorithm"],
                r["device"],
                r["precision"],
                str(r["nproc_per_node"]),
                f"{r['threads_per_rank']} (of {r['total_threads']})",
                f"{r['one_rank_tokens_per_s']:.0f}",
                f"{r['ranks_tokens_per_s']:.0f}",
                f"{r['efficiency']:.3f}",
            ]
        )
    values = {"records": [{k: v for k, v in r.items() if k != "legs"} for r in records]}
    return Record("Data-parallel scaling", [about, Table(columns, rows)], values, Provenance.now())


def publish(found: Record, page_name: str, out: Path | None) -> None:
    """Add the record to its page, or write its markdown to `out` (the GPU check's own runs)."""
    if out is not None:
        out.write_text(found.markdown() + "\n")
        return
    page = Page.named(GROUP, page_name)
    print(f"recorded {page.add(found)}; rendered {page.path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "medium", "smollm"], choices=list(SIZES))
    parser.add_argument("--algorithms", nargs="+", default=["dflash", "dflash2"], choices=["dflash", "dflash2"])
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "bf16"],
        choices=["fp32", "bf16"],
        help="both sides run under each: fp32, or bf16 autocast with fp32 master weights",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the record's markdown here instead of to its page")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny size, fp32, 2 steps, results not written: checks the benchmark runs and parity holds",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="N > 1: measure data-parallel scaling instead (global tokens/s of N torchrun ranks over 1 rank with "
        "the same total threads), recorded in benchmarks/training/SCALING.md",
    )
    parser.add_argument("--rank-throughput", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-output", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    parser.add_argument("--theirs-config", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.precisions, args.steps, args.warmup = ["tiny"], ["fp32"], 2, 1
    one = (args.sizes[0], args.algorithms[0], args.device, args.precisions[0], args.steps, args.warmup)
    if args.rank_throughput:
        rank_throughput(*one, args.rank_output)
        return 0
    if args.nproc_per_node > 1:
        repeats = 1 if args.smoke else 2
        records = [
            scaling(size, algorithm, args.device, precision, args.nproc_per_node, args.steps, args.warmup, repeats)
            for size in args.sizes
            for algorithm in args.algorithms
            for precision in args.precisions
        ]
        for record in records:
            print(json.dumps(record), flush=True)
        if not args.smoke:
            publish(scaling_record(records), "SCALING", args.out)
        return 1 if any("error" in r for r in records) else 0
    if args.probe:
        print(
            memory_probe(
                args.sizes[0], args.algorithms[0], args.probe, args.device, args.precisions[0], args.theirs_config
            )
        )
        return 0
    records = []
    for size in args.sizes:
        if SIZES[size].cuda_only and not args.device.startswith("cuda"):
            print(json.dumps({"size": size, "skipped": "CUDA only"}), flush=True)
            continue
        for algorithm in args.algorithms:
            for precision in args.precisions:
                record = measure(size, algorithm, args.device, precision, args.steps, args.warmup)
                print(json.dumps(record), flush=True)
                records.append(record)
    if args.smoke:
        return 1 if any("error" in r for r in records) else 0
    publish(results_record(records), "TRAIN_STEP", args.out)
    return 0


if __name__ == "__main__":
    exit_rank_after(main)
