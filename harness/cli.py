"""`dflash-lab`: prepare, train, export, study, report. The one module that may import studies and reports."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash_lab")

# flag -> (knob name, type); names follow speculators so users already know them
KNOB_FLAGS: dict[str, tuple[str, Any]] = {
    "--block-size": ("block_size", int),
    "--num-layers": ("num_draft_layers", int),
    "--target-layer-ids": ("target_layer_ids", lambda s: [int(x) for x in s.replace(",", " ").split()]),
    "--mask-token-id": ("mask_token_id", int),
    "--block-attention": ("block_attention", str),
    "--loss-fn": ("loss", str),
    "--per-position-loss-weight": ("position_weighting", str),
    "--dflash-decay-gamma": ("decay_gamma", float),
    "--dpace-alpha": ("dpace_alpha", float),
    "--max-anchors": ("max_anchors", int),
    "--conv-kernel-size": ("conv_kernel_size", int),
    "--conv-group-size": ("conv_group_size", int),
    "--selector-rank": ("selector_rank", int),
    "--selector-top-k": ("selector_top_k", int),
    "--selector-loss-alpha": ("selector_loss_alpha", float),
    "--metrics-top-k": ("metrics_top_k", int),
}
TRAIN_FLAGS: dict[str, tuple[str, Any]] = {
    "--lr": ("learning_rate", float),
    "--max-steps": ("max_steps", int),
    "--seed": ("seed", int),
    "--eval-every": ("eval_every", int),
    "--schedule": ("schedule", str),
    "--precision": ("precision", str),
}
DATA_FLAGS: dict[str, tuple[str, Any]] = {
    "--num-conversations": ("num_conversations", int),
    "--num-validation": ("num_validation", int),
    "--row-length": ("row_length", int),
    "--data-split": ("split", str),
}


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=Path("work"), help="caches, runs and the MLflow store (default: ./work)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--algorithm", choices=["dflash", "dflash2"], default="dflash2", help="draft algorithm (default: dflash2)"
    )
    parser.add_argument(
        "--target",
        default="smollm2-135m",
        help="embedded target name, local HF model dir or hub id (default: smollm2-135m)",
    )
    parser.add_argument("--data", help="dataset: 'chitchat' (embedded), a messages JSONL file or an HF dataset id")
    parser.add_argument("--config", type=Path, help="YAML run config; flags given on the command line override it")
    parser.add_argument(
        "--preset",
        choices=["small", "published"],
        help="knob preset (default: small for the embedded target, else published)",
    )
    parser.add_argument(
        "--sample-from-anchor",
        dest="sample_from_anchor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="predict from the anchor slot too (DSpark style; dflash only)",
    )
    for flag, (name, _) in {**KNOB_FLAGS, **TRAIN_FLAGS, **DATA_FLAGS}.items():
        parser.add_argument(flag, dest=name, default=None, help=f"knob {name}")


def resolve_run_config(args: argparse.Namespace):
    """Preset -> YAML config -> command-line flags, in that order of precedence (last wins)."""
    import dataclasses

    from harness.config import RunConfig, load_yaml
    from harness.presets import preset_run

    base = preset_run(
        args.preset or ("small" if args.target == "smollm2-135m" else "published"), args.algorithm, args.target
    )
    data = base.to_dict()
    if args.config:
        loaded = load_yaml(args.config)
        for section in ("shared", "knobs", "train", "data"):
            data[section].update(loaded.pop(section, {}))
        data.update(loaded)
    data["algorithm"], data["target"] = args.algorithm, args.target
    if args.data:
        data["data"]["dataset"] = args.data
    for flags, section in ((KNOB_FLAGS, None), (TRAIN_FLAGS, "train"), (DATA_FLAGS, "data")):
        for flag, (name, kind) in flags.items():
            value = getattr(args, name)
            if value is None:
                continue
            try:
                value = kind(value)
            except ValueError:
                raise SystemExit(
                    f"error: {flag}={value!r} is not a valid {getattr(kind, '__name__', 'list of ints')}"
                ) from None
            target_section = section or (
                "shared" if name in {f.name for f in dataclasses.fields(type(base.algorithm.shared))} else "knobs"
            )
            data[target_section][name] = value
    if args.sample_from_anchor is not None:
        data["shared"]["sample_from_anchor"] = args.sample_from_anchor
    try:
        config = RunConfig.from_dict(data)
        config.validate()
    except (TypeError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    return config


def dry_run(config, target_name: str, workdir: Path) -> dict:
    """Resolved knobs, draft config and parameter counts, without loading weights or data."""
    import torch

    from algorithms.registry import DRAFT_CLASSES, draft_config
    from harness.export import checkpoint_config
    from harness.targets import target_config, target_spec

    spec = target_spec(target_config(target_name, workdir), target_name)
    algorithm = config.algorithm
    if algorithm.shared.mask_token_id is None:
        algorithm = algorithm.replace(mask_token_id=0)  # placeholder for shape counting only; chosen at train time
    resolved = draft_config(algorithm, spec)
    with torch.device("meta"):
        embed = torch.empty(spec.vocab_size, spec.hidden_size)
        draft = DRAFT_CLASSES[algorithm.algorithm](resolved, algorithm, embed, embed)
    shapes = {name: list(tensor.shape) for name, tensor in draft.state_dict().items()}
    return {
        "config": config.to_dict(),
        "target_layer_ids": resolved.target_layer_ids,
        "trainable_parameters": sum(p.numel() for p in draft.parameters()),
        "checkpoint_config": checkpoint_config(draft, target_name),
        "tensor_shapes": shapes,
    }


def cmd_train(args: argparse.Namespace) -> int:
    from harness import tracking
    from harness.train import prepare_workspace, train

    config = resolve_run_config(args)
    if args.dry_run:
        print(json.dumps(dry_run(config, args.target, args.workdir), indent=2))
        return 0
    workspace = prepare_workspace(config, args.workdir, args.device)
    result = train(config, workspace, run_name=args.run_name, resume=args.resume, device=args.device)
    print(json.dumps({k: round(v, 4) for k, v in result.validation.items() if "position" not in k}, indent=2))
    print(f"MLflow run {result.run_id}; outputs in {result.run_dir}")
    print(f"Open the UI with: {tracking.ui_command(args.workdir)}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from harness.train import prepare_workspace

    config = resolve_run_config(args)
    workspace = prepare_workspace(config, args.workdir, args.device)
    print(
        f"target {workspace.target.name} ({workspace.target.weights_hash}), mask "
        f"token {workspace.target.mask_token_id}: {workspace.target.mask_token_reason}"
    )
    print(
        f"data {workspace.data.dataset_id} ({workspace.data.dataset_hash}): "
        f"{len(workspace.data.train)} train / {len(workspace.data.validation)} validation documents"
    )
    print(f"features {'reused' if workspace.feature_cache_hit else 'built'}: {workspace.features.directory}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from harness.export import export_checkpoint
    from harness.targets import load_target

    run_dir, state, config = load_checkpoint(args.run, args.workdir)
    target = load_target(config.target, args.workdir, config.algorithm.shared.mask_token_id)
    draft = restore_draft(config, state, target)
    out = export_checkpoint(draft, args.out or run_dir / "export", target.source)
    print(f"exported {config.algorithm.algorithm} draft (step {state['step']}) to {out}")
    print(f"serve with: vllm serve {out}   (verifier: {target.source})")
    return 0


def load_checkpoint(run: Path, workdir: Path):
    """(run_dir, state, config) of a run directory or run name."""
    import torch

    from harness.config import RunConfig

    run_dir = run if run.is_dir() else workdir / "runs" / str(run)
    checkpoint = run_dir / "checkpoint.pt"
    if not checkpoint.exists():
        raise SystemExit(
            f"error: no checkpoint at {checkpoint}; pass a run directory or a run name under {workdir / 'runs'}"
        )
    state = torch.load(checkpoint, weights_only=False)
    return run_dir, state, RunConfig.from_dict(state["config"])


def restore_draft(config, state: dict, target, device: str = "cpu"):
    from harness.train import build_for_target

    draft = build_for_target(config, target).to(device)
    draft.load_state_dict(state["model"])
    return draft


def cmd_evaluate(args: argparse.Namespace) -> int:
    from harness import tracking
    from harness.evaluate import EVAL_PREFIX, EvalConfig, evaluate, log_evaluation
    from harness.train import prepare_workspace

    run_dir, state, config = load_checkpoint(args.run, args.workdir)
    workspace = prepare_workspace(config, args.workdir, args.device)
    draft = restore_draft(config, state, workspace.target, args.device)
    eval_config = EvalConfig(
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures)
    )
    metrics, records = evaluate(workspace.target, draft, workspace.data.validation, eval_config)
    log_evaluation(args.workdir, state["run_id"], metrics, records, run_dir)
    for name in (
        "measured_accepted_length_greedy",
        "measured_accepted_length_t1",
        "chat_offline_realized_accepted_length",
        "chat_offline_realized_accepted_length_replayed",
        "chat_measured_accepted_length_greedy_pooled",
        "mtbench_lossless_fraction",
        "chat_lossless_fraction",
    ):
        if name in metrics:
            print(f"{EVAL_PREFIX}{name}: {metrics[name]:.4f}")
    print(f"logged to MLflow run {state['run_id']}; per-request records in {run_dir / 'eval_records.json'}")
    print(f"Open the UI with: {tracking.ui_command(args.workdir)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-lab", description="Train, compare and ablate DFlash-family draft models."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train", help="train one tracked draft run", description="Train one DFlash/DFlash2 draft, tracked in MLflow."
    )
    add_common(train)
    add_run_options(train)
    train.add_argument("--run-name", help="run directory / MLflow run name (default: <algorithm>-<config hash>)")
    train.add_argument(
        "--resume", action="store_true", help="continue the run from its last checkpoint, in the same MLflow run"
    )
    train.add_argument(
        "--dry-run", action="store_true", help="print resolved knobs, draft config and parameter counts; load nothing"
    )
    train.set_defaults(handler=cmd_train)

    prepare = commands.add_parser(
        "prepare",
        help="regenerate data and build the feature cache ahead of time",
        description="Regenerate responses with the target and extract the shared feature cache.",
    )
    add_common(prepare)
    add_run_options(prepare)
    prepare.set_defaults(handler=cmd_prepare)

    export = commands.add_parser(
        "export",
        help="write a servable Z Lab / speculators / vLLM checkpoint",
        description="Export a run's last checkpoint in the native layout with a dual config.",
    )
    add_common(export)
    export.add_argument("run", type=Path, help="run directory or run name")
    export.add_argument("--out", type=Path, help="output directory (default: <run>/export)")
    export.set_defaults(handler=cmd_export)

    evaluate = commands.add_parser(
        "evaluate",
        help="measure acceptance by real speculative decoding (MT-bench + held-out chat)",
        description="Decode with the target verifying the draft; log measured acceptance beside the offline metrics.",
    )
    add_common(evaluate)
    evaluate.add_argument("run", type=Path, help="run directory or run name")
    evaluate.add_argument("--num-prompts", type=int, default=20, help="prompts per set (default: 20)")
    evaluate.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default: 128)")
    evaluate.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="decoding temperatures (default: 0 1)"
    )
    evaluate.set_defaults(handler=cmd_evaluate)

    from reports.cli import add_report_command
    from studies.cli import add_study_command

    add_study_command(commands, add_common)
    add_report_command(commands, add_common)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
