"""What DFlash2 costs over DFlash: training-step time (ours and speculators', identical shared knobs)
and, at inference on the embedded target, the share of a decoding cycle spent in the selector walk and
the convolutions.

    python -m benchmarks.training.overhead [--size medium] [--precisions fp32 bf16] [--workdir work] [--device cuda]

Prints one JSON line per measurement and records in benchmarks/training/OVERHEAD.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.training.train_step import SIZES, build, steppers, timed
from harness.devices import synchronize


def training_overhead(size: str, steps: int, precision: str, device: str = "cpu") -> dict:
    """DFlash2 / DFlash step time, for ours and for speculators, interleaved on the same batch shapes."""
    pairs = {
        algorithm: steppers(*build(SIZES[size], algorithm, device), precision) for algorithm in ("dflash", "dflash2")
    }
    for algorithm in pairs:
        for step in pairs[algorithm]:
            step()
    times = {(a, who): [] for a in pairs for who in ("ours", "theirs")}
    for _ in range(steps):
        for algorithm, (ours_step, theirs_step) in pairs.items():
            times[(algorithm, "ours")].append(timed(ours_step, device))
            times[(algorithm, "theirs")].append(timed(theirs_step, device))
    median = {key: statistics.median(values) for key, values in times.items()}
    return {
        "size": size,
        "device": device,
        "precision": precision,
        "ours_dflash2_over_dflash": median[("dflash2", "ours")] / median[("dflash", "ours")],
        "theirs_dflash2_over_dflash": median[("dflash2", "theirs")] / median[("dflash", "theirs")],
        **{f"{who}_{a}_median_ms": 1000 * v for (a, who), v in median.items()},
    }


def inference_shares(workdir: Path, cycles: int, device: str = "cpu") -> dict:
    """Time of the selector walk and of the convs inside one draft step, relative to a whole decoding cycle."""
    from harness.features import target_features
    from harness.presets import preset_run
    from harness.targets import load_target
    from harness.train import build_for_target, with_target_defaults

    target = load_target("smollm2-135m", workdir, device=device)
    config = with_target_defaults(preset_run("small", "dflash2", "smollm2-135m"), target)
    draft = build_for_target(config, target).to(device).eval()
    with torch.no_grad():
        for name, param in draft.named_parameters():  # trained-like, non-identity convs and selector
            if "conv" in name or "candidate_selector" in name:
                param.normal_(std=0.02)
    prompt = target.tokenizer("Tell me about the history of the bicycle in a few sentences.", return_tensors="pt")[
        "input_ids"
    ].to(device)
    with torch.no_grad():
        out = target.model(input_ids=prompt, output_hidden_states=True)
    features = target_features(out.hidden_states, draft.config.target_layer_ids)[0]
    length = features.shape[0]
    positions = torch.arange(length, device=device)
    block = torch.cat([prompt[0, -1:], torch.randint(0, 1000, (draft.block_size - 1,), device=device)])[None]

    conv_seconds = [0.0]

    def timed_conv(module, inputs, output):  # forward hooks bracket each conv call
        synchronize(device)
        conv_seconds[0] += time.perf_counter() - module._started

    def start_conv(module, inputs):
        synchronize(device)
        module._started = time.perf_counter()

    hooks = []
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            hooks += [conv.register_forward_pre_hook(start_conv), conv.register_forward_hook(timed_conv)]
    draft_s, walk_s, verify_s = [], [], []
    with torch.no_grad():
        for _ in range(cycles):
            conv_seconds[0] = 0.0
            synchronize(device)
            started = time.perf_counter()
            hidden = draft.single_block_hidden(features, positions, int(prompt[0, -1]), length, draft.block_size)
            synchronize(device)
            backbone = time.perf_counter()
            draft.output_logits(hidden)[1:].topk(draft.candidate_top_k, dim=-1)
            synchronize(device)
            head = time.perf_counter()
            # head + top-K + walk, with the head over the whole block exactly as `propose` computes it
            draft.propose_from_hidden(hidden[1:], draft.output_logits(hidden)[1:], int(prompt[0, -1]), 0.0, None)
            synchronize(device)
            walked = time.perf_counter()
            target.model(input_ids=torch.cat([prompt, block], 1))
            synchronize(device)
            verified = time.perf_counter()
            draft_s.append((walked - started - (head - backbone), conv_seconds[0]))
            walk_s.append(max(0.0, (walked - head) - (head - backbone)))
            verify_s.append(verified - walked)
    for hook in hooks:
        hook.remove()
    cycle = statistics.median(d for d, _ in draft_s) + statistics.median(verify_s)
    return {
        "cycle_ms": 1000 * cycle,
        "draft_ms": 1000 * statistics.median(d for d, _ in draft_s),
        "selector_walk_ms": 1000 * statistics.median(walk_s),
        "conv_ms": 1000 * statistics.median(c for _, c in draft_s),
        "conv_share_of_cycle": statistics.median(c for _, c in draft_s) / cycle,
        "selector_walk_share_of_cycle": statistics.median(walk_s) / cycle,
    }


GROUP, PAGE = "training", "OVERHEAD"
TRAINING_GOAL, INFERENCE_GOAL = 1.08, 0.05


def as_record(training: list[dict], inference: dict, device: str = "cpu") -> Record:
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU only"
    about = (
        f"{torch.get_num_threads()} threads, {where}. Training: median step time (forward + backward + clipping), "
        "identical shared knobs, interleaved, same precision for both implementations."
    )
    columns = [
        "size",
        "precision",
        "ours DFlash ms",
        "ours DFlash2 ms",
        "ours DFlash2/DFlash",
        "speculators DFlash2/DFlash",
        "goal (ours)",
    ]
    rows = [
        [
            r["size"],
            r["precision"],
            f"{r['ours_dflash_median_ms']:.0f}",
            f"{r['ours_dflash2_median_ms']:.0f}",
            f"{r['ours_dflash2_over_dflash']:.3f}",
            f"{r['theirs_dflash2_over_dflash']:.3f}",
            f"<= {TRAINING_GOAL}: {'met' if r['ours_dflash2_over_dflash'] <= TRAINING_GOAL else 'NOT met'}",
        ]
        for r in training
    ]
    share = inference["conv_share_of_cycle"] + inference["selector_walk_share_of_cycle"]
    cycle = "\n".join(
        [
            "**Inference**: one greedy decoding cycle on the embedded target (SmolLM2-135M), small preset DFlash2.",
            "",
            f"- cycle {inference['cycle_ms']:.1f} ms (draft {inference['draft_ms']:.1f} ms + target verification)",
            f"- convolutions {inference['conv_ms']:.2f} ms ({100 * inference['conv_share_of_cycle']:.2f}% of the "
            "cycle)",
            f"- selector walk {inference['selector_walk_ms']:.2f} ms "
            f"({100 * inference['selector_walk_share_of_cycle']:.2f}% of the cycle)",
            f"- together {100 * share:.2f}% (goal <= {100 * INFERENCE_GOAL:.0f}%): "
            f"{'met' if share <= INFERENCE_GOAL else 'NOT met'}",
        ]
    )
    values = {"training": training, "inference": inference}
    title = f"{', '.join(dict.fromkeys(r['size'] for r in training))} on {where}"
    return Record(title, [about, Table(columns, rows), cycle], values, Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", choices=list(SIZES), help="qwen3-8b needs CUDA")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument(
        "--workdir", type=Path, default=Path("work"), help="holds (or receives) the converted embedded target"
    )
    page_argument(parser, GROUP, PAGE)
    parser.add_argument("--out", type=Path, help="write the record's markdown here instead (the GPU check's own run)")
    args = parser.parse_args(argv)
    if SIZES[args.size].cuda_only and not args.device.startswith("cuda"):
        parser.error(f"invalid --size={args.size!r} with --device={args.device!r}: allowed with a cuda device only")
    training = []
    for precision in args.precisions:
        training.append(training_overhead(args.size, args.steps, precision, args.device))
        print(json.dumps(training[-1]), flush=True)
    inference = inference_shares(args.workdir, args.cycles, args.device)
    print(json.dumps(inference), flush=True)
    found = as_record(training, inference, args.device)
    if args.out is not None:
        args.out.write_text(found.markdown() + "\n")
    else:
        page = Page.named(GROUP, args.page or PAGE)
        print(f"recorded {page.add(found)}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
