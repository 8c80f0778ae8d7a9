"""Training-step speed and memory, side by side with speculators 0.9.0 on identical shapes, knobs, weights and batch.

    python -m benchmarks.train_step --sizes tiny medium smollm --algorithms dflash dflash2

Prints one JSON line per measurement and writes benchmarks/RESULTS.md. Losses must agree within
1e-3 relative before anything is timed. Steps are forward + backward + grad clipping, interleaved
A B A B; peak memory is measured in a fresh process per implementation (RSS on CPU,
max_memory_allocated on CUDA).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from algorithms import AlgorithmConfig, TargetSpec, build_draft
from algorithms.blocks import PackedRow, sample_anchors
from algorithms.modeling import RMSNorm
from benchmarks.peers import fixed_anchors, speculators_draft, speculators_inputs, speculators_train_kwargs


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


SIZES = {
    "tiny": Size(256, 4, 2, 64, 768, 2048, 2, 32, 8, 512),
    "medium": Size(1024, 16, 8, 64, 3072, 32000, 1, 128, 8, 1024),
    "smollm": Size(576, 9, 3, 64, 1536, 49152, 5, 64, 8, 1024, target_layers=30),
    "qwen3-8b": Size(4096, 32, 8, 128, 12288, 151936, 5, 512, 8, 8192, target_layers=36, cuda_only=True),
}


def build(size: Size, algorithm: str, device: str, seed: int = 0):
    """Ours and theirs with identical weights, plus one packed row and its anchors."""
    torch.manual_seed(seed)
    target = TargetSpec(num_hidden_layers=size.target_layers, hidden_size=size.hidden, num_attention_heads=size.heads,
                        num_key_value_heads=size.kv_heads, head_dim=size.head_dim, intermediate_size=size.intermediate,
                        vocab_size=size.vocab, rms_norm_eps=1e-6, rope_theta=1e6)
    knobs = dict(block_size=size.block, num_draft_layers=size.draft_layers, max_anchors=size.anchors, mask_token_id=5,
                 loss="kl_div", position_weighting="fixed-exp-decay", block_attention="bidirectional")
    if algorithm == "dflash2":
        knobs.update(selector_init="normal")
    else:
        knobs.update(metrics_top_k=16)
    embed = torch.randn(size.vocab, size.hidden) * 0.02
    head = torch.randn(size.vocab, size.hidden) * 0.02
    ours = build_draft(AlgorithmConfig.preset(algorithm, **knobs), target, embed, head).to(device)
    attention = "simple_flex_attention" if device.startswith("cuda") else "sdpa"
    theirs = speculators_draft(ours.cpu(), attention).to(device)
    ours.to(device)

    generator = torch.Generator().manual_seed(seed)
    length, docs = size.tokens, 4
    document_ids = torch.arange(length) * docs // length
    starts = torch.searchsorted(document_ids, torch.arange(docs))
    position_ids = torch.arange(length) - starts[document_ids]
    loss_mask = (position_ids >= 16).float()
    raw_last = torch.randn(length, size.hidden, generator=generator)
    norm = RMSNorm(size.hidden, 1e-6)
    with torch.no_grad():
        row = PackedRow(torch.randint(0, size.vocab, (length,), generator=generator), loss_mask, document_ids, position_ids,
                        torch.randn(length, len(ours.config.target_layer_ids) * size.hidden, generator=generator), norm(raw_last))
    anchors = sample_anchors(row.loss_mask, row.document_ids, size.block, size.anchors, generator)
    row, anchors = row.to(device), type(anchors)(anchors.positions.to(device), anchors.valid.to(device))
    return ours, theirs, row, raw_last.to(device), anchors


def steppers(ours, theirs, row, raw_last, anchors):
    inputs, kwargs = speculators_inputs(row, raw_last), speculators_train_kwargs(ours)
    ours_params = [p for p in ours.parameters() if p.requires_grad]
    theirs_params = [p for p in theirs.parameters() if p.requires_grad]

    def ours_step() -> float:
        loss = ours.training_forward(row, anchors).loss
        ours.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours_params, 1.0)
        return float(loss.detach())

    def theirs_step() -> float:
        with fixed_anchors(anchors):
            _, loss, _ = theirs(**inputs, **kwargs)
        theirs.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs_params, 1.0)
        return float(loss.detach())

    return ours_step, theirs_step


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(step, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - started


def current_rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def memory_probe(size_name: str, algorithm: str, which: str, device: str, steps: int = 3) -> float:
    """Peak memory growth (MiB) over a few steps of one implementation, the other one freed first."""
    ours, theirs, row, raw_last, anchors = build(SIZES[size_name], algorithm, device)
    ours_step, theirs_step = steppers(ours, theirs, row, raw_last, anchors)
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


def probe_in_subprocess(size: str, algorithm: str, which: str, device: str) -> float:
    out = subprocess.run([sys.executable, "-m", "benchmarks.train_step", "--probe", which, "--sizes", size,
                          "--algorithms", algorithm, "--device", device], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(size_name: str, algorithm: str, device: str, steps: int, warmup: int) -> dict:
    ours, theirs, row, raw_last, anchors = build(SIZES[size_name], algorithm, device)
    ours_step, theirs_step = steppers(ours, theirs, row, raw_last, anchors)
    ours_loss, theirs_loss = ours_step(), theirs_step()
    relative = abs(ours_loss - theirs_loss) / abs(theirs_loss)
    record = {"size": size_name, "algorithm": algorithm, "device": device, "ours_loss": ours_loss, "theirs_loss": theirs_loss,
              "loss_relative_difference": relative}
    if relative > 1e-3:
        record["error"] = "losses disagree by more than 1e-3 relative: refusing to time"
        return record
    for _ in range(warmup):
        ours_step(), theirs_step()
    ours_times, theirs_times = [], []
    for _ in range(steps):  # interleaved A B A B, so drift on a noisy machine hits both alike
        ours_times.append(timed(ours_step, device))
        theirs_times.append(timed(theirs_step, device))
    ratios = [a / b for a, b in zip(ours_times, theirs_times)]
    del ours, theirs
    ours_mem = probe_in_subprocess(size_name, algorithm, "ours", device)
    theirs_mem = probe_in_subprocess(size_name, algorithm, "theirs", device)
    record.update({
        "steps": steps, "ours_median_ms": 1000 * statistics.median(ours_times), "ours_min_ms": 1000 * min(ours_times),
        "theirs_median_ms": 1000 * statistics.median(theirs_times), "theirs_min_ms": 1000 * min(theirs_times),
        "time_ratio_median": statistics.median(ratios), "time_ratio_min": min(ratios),
        "ours_peak_mib": ours_mem, "theirs_peak_mib": theirs_mem, "memory_ratio": ours_mem / theirs_mem if theirs_mem else float("nan"),
    })
    return record


def write_results(records: list[dict], path: Path) -> None:
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("torch", "transformers", "speculators")}
    lines = [
        "# Training-step benchmark: dflash-lab vs speculators 0.9.0",
        "",
        f"- Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {platform.machine()}, {platform.processor() or platform.platform()}, {torch.get_num_threads()} threads"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only"),
        f"- Versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
        "- Step = forward + backward + grad clipping on the same flattened batch; interleaved A B; ratio = ours / theirs per pair.",
        "- speculators on CPU: sdpa attention and its eager losses. Peak memory: RSS growth over the steps (CPU) or max_memory_allocated (CUDA), each in a fresh process.",
        "",
        "| size | algorithm | device | loss rel. diff | ours median ms | theirs median ms | time ratio (median) | ours peak MiB | theirs peak MiB | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['algorithm']} | {r['device']} | {r['loss_relative_difference']:.2e} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['size']} | {r['algorithm']} | {r['device']} | {r['loss_relative_difference']:.2e} | {r['ours_median_ms']:.1f} | "
                     f"{r['theirs_median_ms']:.1f} | {r['time_ratio_median']:.3f} | {r['ours_peak_mib']:.0f} | {r['theirs_peak_mib']:.0f} | {r['memory_ratio']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "medium", "smollm"], choices=list(SIZES))
    parser.add_argument("--algorithms", nargs="+", default=["dflash", "dflash2"], choices=["dflash", "dflash2"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "RESULTS.md")
    parser.add_argument("--smoke", action="store_true", help="tiny size, 2 steps, results not written: checks the benchmark runs and parity holds")
    parser.add_argument("--probe", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.steps, args.warmup = ["tiny"], 2, 1
    if args.probe:
        print(memory_probe(args.sizes[0], args.algorithms[0], args.probe, args.device))
        return 0
    records = []
    for size in args.sizes:
        if SIZES[size].cuda_only and not args.device.startswith("cuda"):
            print(json.dumps({"size": size, "skipped": "CUDA only"}), flush=True)
            continue
        for algorithm in args.algorithms:
            record = measure(size, algorithm, args.device, args.steps, args.warmup)
            print(json.dumps(record), flush=True)
            records.append(record)
    if args.smoke:
        return 1 if any("error" in r for r in records) else 0
    write_results(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
