"""`dflash-lab`: prepare, train, export, study, report. The one module that may import studies and reports."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger("dflash_lab")

DEFAULT_ALGORITHM, DEFAULT_TARGET = "dflash2", "smollm2-135m"


def probability(text: str) -> float:
    """An argparse type: a number in [0, 1] (argparse names the flag in its one-line error)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed a number in [0, 1]")
    return value


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=Path("work"), help="caches, runs and the MLflow store (default: ./work)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    from algorithms import ALGORITHMS
    from harness.knob_flags import add_knob_flags
    from harness.presets import PRESETS

    parser.add_argument(
        "--algorithm",
        choices=list(ALGORITHMS),
        help=f"draft algorithm (default: the config file's, else {DEFAULT_ALGORITHM})",
    )
    parser.add_argument(
        "--target",
        help="embedded target name, local HF model dir, or hub id (org/name[@REVISION] pins a revision; "
        f"default: the config file's, else {DEFAULT_TARGET})",
    )
    parser.add_argument("--config", type=Path, help="YAML run config; flags given on the command line override it")
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="knob defaults (default: small for the embedded target, else published)",
    )
    add_knob_flags(parser)


def resolve_run_config(args: argparse.Namespace):
    """Preset, then the YAML config, then the flags given on the command line (last wins)."""
    from algorithms.knobs import KnobError
    from harness.config import CONFIG_SECTION, RunConfig, file_knobs, load_yaml
    from harness.data import check_local_dataset
    from harness.knob_flags import flag_overrides
    from harness.presets import preset_run

    loaded = load_yaml(args.config) if args.config else {}
    from_file = file_knobs(loaded)
    try:
        algorithm = args.algorithm or loaded.pop("algorithm", DEFAULT_ALGORITHM)
        target = args.target or loaded.pop("target", DEFAULT_TARGET)
        data = preset_run(args.preset or ("small" if target == DEFAULT_TARGET else "published"), algorithm, target)
        data = data.to_dict()
        for section, overrides in flag_overrides(args).items():
            data[section].update(loaded.pop(section, {}) or {})
            data[section].update(overrides)
        data.update(loaded, algorithm=algorithm, target=target)
        config = RunConfig.from_dict(data)
        config.validate()
        check_local_dataset(config.data.dataset)
    except (TypeError, ValueError) as error:
        named = isinstance(error, KnobError) and (
            error.knob == CONFIG_SECTION or error.knob.rsplit(".", 1)[-1] in from_file
        )
        raise SystemExit(f"error: {args.config}: {error}" if named else f"error: {error}") from None
    return config


def planned_draft(config, workdir: Path):
    """The draft `config` would build, on the meta device: checks every target-dependent knob against the
    target's config alone, before any weights or data are loaded."""
    import torch

    from algorithms import build_draft
    from harness import devices
    from harness.targets import target_config, target_spec

    algorithm = config.algorithm
    if algorithm.shared.mask_token_id is None:
        algorithm = algorithm.replace(mask_token_id=0)  # placeholder for shape counting only; chosen at train time
    algorithm = algorithm.replace(draft_init="random")  # the shapes are the same, and no target weights are loaded
    try:
        spec = target_spec(target_config(config.target, workdir), config.target)
        with devices.shapes_only():
            embed = torch.empty(spec.vocab_size, spec.hidden_size)
            return build_draft(algorithm, spec, embed, embed)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def dry_run(config, workdir: Path) -> dict:
    """Resolved knobs, draft config and parameter counts, without loading weights or data."""
    from harness.export import NoPeerFormat, checkpoint_config

    draft = planned_draft(config, workdir)
    try:
        export = checkpoint_config(draft, config.target)
    except NoPeerFormat as refusal:
        export = str(refusal)
    return {
        "config": config.to_dict(),
        "target_layer_ids": draft.config.target_layer_ids,
        "trainable_parameters": sum(p.numel() for p in draft.parameters()),
        "checkpoint_config": export,
        "feature_cache": cache_plan(config, draft, workdir),
        "tensor_shapes": {name: list(tensor.shape) for name, tensor in draft.state_dict().items()},
    }


def cache_plan(config, draft, workdir: Path) -> dict:
    """The disk the feature cache would need, from the token count, layers, hidden size and dtypes, against the
    free space where it would go; a warning (also logged) when it would not fit and the mode is `cache`."""
    import shutil

    from harness.config import CACHE_FEATURES
    from harness.devices import dtype_name
    from harness.features import estimated_bytes, final_dtype
    from harness.targets import native_dtype, target_config

    tokens = config.data.num_conversations * config.data.max_length  # at most: every document truncated there
    hidden = draft.embed_weight.shape[1]
    target_dtype = native_dtype(target_config(config.target, workdir))
    needed = estimated_bytes(tokens, hidden, len(draft.config.target_layer_ids), target_dtype)
    place = next(p for p in [workdir.resolve(), *workdir.resolve().parents] if p.exists())
    free = shutil.disk_usage(place).free
    plan = {
        "mode": config.train.features,
        "tokens_at_most": tokens,
        "final_hidden_dtype": dtype_name(final_dtype(target_dtype)),
        "bytes_at_most": needed,
        "gib_at_most": round(needed / 2**30, 2),
        "free_gib": round(free / 2**30, 2),
    }
    if needed > free and config.train.features == CACHE_FEATURES:
        plan["warning"] = (
            f"the feature cache may need {needed / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free at {place}; "
            "--features online computes the features inside each training step and writes nothing"
        )
        logging.getLogger(__name__).warning(plan["warning"])
    return plan


def add_distributed_options(parser: argparse.ArgumentParser) -> None:
    from harness.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S

    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="data-parallel ranks on this machine: relaunches itself under torchrun (default: 1; under "
        "`torchrun --nproc_per_node N -m harness.cli ...` torchrun's own setting applies)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        help=f"seconds a rank waits in a collective for a lost rank before the run fails "
        f"(default: {DEFAULT_COLLECTIVE_TIMEOUT_S:.0f})",
    )


def relaunch_under_torchrun(args: argparse.Namespace) -> int | None:
    """`--nproc-per-node N` outside torchrun: run this same command as N ranks under torchrun, return its exit
    status. None when this process is already a rank (or N is 1)."""
    from harness.distributed import launched_by_torchrun, run_ranks
    from harness.run import Run
    from harness.tracking import RunStatus

    if args.nproc_per_node < 1:
        raise SystemExit(f"error: invalid --nproc-per-node={args.nproc_per_node}: allowed an integer >= 1")
    if not args.collective_timeout > 0:
        raise SystemExit(f"error: invalid --collective-timeout={args.collective_timeout}: allowed seconds > 0")
    if args.nproc_per_node == 1 or launched_by_torchrun():
        return None
    ended = run_ranks(args.nproc_per_node, "harness.cli", args.argv, args.workdir)
    if ended.lost is None:
        return ended.status
    if ended.run_directory is not None and Run.at(ended.run_directory).record_ending(RunStatus.FAILED, ended.lost):
        raise SystemExit(
            f"error: {ended.lost}; its run {ended.run_directory.name!r} is recorded failed "
            "(`--resume` continues it from its last checkpoint)"
        )
    raise SystemExit(f"error: {ended.lost}")


def cmd_train(args: argparse.Namespace) -> int:
    from harness import tracking
    from harness.distributed import joined
    from harness.run import check_run_name
    from harness.train import prepare_workspace, train

    if args.run_name is not None:
        check_run_name(args.run_name, "--run-name")
    if getattr(args, "train.branch_of", None) is not None:
        config = branch_run_config(args)
        args.run_name = args.run_name or f"{config.train.branch_of}-decay{config.train.max_steps}"
    else:
        config = resolve_run_config(args)
    if args.dry_run:
        print(json.dumps(dry_run(config, args.workdir), indent=2))
        return 0
    planned_draft(config, args.workdir)
    if (relaunched := relaunch_under_torchrun(args)) is not None:
        return relaunched
    with joined(args.device, args.collective_timeout) as (ranks, device):
        workspace = prepare_workspace(config, args.workdir, device, ranks)
        result = train(
            config,
            workspace,
            run_name=args.run_name,
            resume=args.resume,
            device=device,
            system_metrics=args.system_metrics,
            ranks=ranks,
        )
    if ranks.is_main:
        print(json.dumps({k: round(v, 4) for k, v in result.validation.items() if "position" not in k}, indent=2))
        print(f"MLflow run {result.run_id}; outputs in {result.run_dir}")
        print(tracking.ui_hint(args.workdir, tracking.DEFAULT_EXPERIMENT))
    return 0


def branch_run_config(args: argparse.Namespace):
    """A WSD branch takes every knob from its parent run (its config.json); only --max-steps, its budget, and
    --run-name are its own."""
    import dataclasses

    from harness.config import RunConfig
    from harness.knob_flags import flag_overrides
    from harness.run import CONFIG_FILE, Run, check_run_name

    parent = check_run_name(getattr(args, "train.branch_of"), "--branch-of")
    overrides = flag_overrides(args)
    given = sorted(f"{section}.{name}" for section, values in overrides.items() for name in values)
    own = [name for name in given if name not in ("train.max_steps", "train.branch_of")]
    others = own + [f"--{name}" for name in ("config", "algorithm", "target", "preset") if getattr(args, name)]
    if others:
        raise SystemExit(
            f"error: invalid --branch-of={parent!r} with {others[0]}: a branch takes every knob from the run it "
            "branches from; allowed --max-steps (its budget) and --run-name"
        )
    if "train.max_steps" not in given:
        raise SystemExit(f"error: invalid --branch-of={parent!r}: allowed with --max-steps, the branch's budget")
    path = Run(args.workdir, parent).path(CONFIG_FILE)
    if not path.is_file():
        raise SystemExit(f"error: invalid --branch-of={parent!r}: no run of that name in {args.workdir}")
    stored = RunConfig.from_dict(json.loads(path.read_text()))
    train = dataclasses.replace(stored.train, max_steps=overrides["train"]["max_steps"], branches=[], branch_of=parent)
    branch = dataclasses.replace(stored, train=train)
    try:
        branch.validate()
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return branch


def cmd_prepare(args: argparse.Namespace) -> int:
    from harness.config import ONLINE_FEATURES
    from harness.distributed import joined
    from harness.train import prepare_workspace

    config = resolve_run_config(args)
    draft = planned_draft(config, args.workdir)
    if args.dry_run:
        print(json.dumps(cache_plan(config, draft, args.workdir), indent=2))
        return 0
    if (relaunched := relaunch_under_torchrun(args)) is not None:
        return relaunched
    with joined(args.device, args.collective_timeout) as (ranks, device):
        workspace = prepare_workspace(config, args.workdir, device, ranks)
    if not ranks.is_main:
        return 0
    print(
        f"target {workspace.target.name} ({workspace.target.weights_hash}), mask "
        f"token {workspace.target.mask_token_id}: {workspace.target.mask_token_reason}"
    )
    print(
        f"data {workspace.data.dataset_id} ({workspace.data.dataset_hash}): "
        f"{len(workspace.data.train)} train / {len(workspace.data.validation)} validation documents"
    )
    if config.train.features == ONLINE_FEATURES:
        print("features online: computed by the target inside each training step, nothing extracted")
    else:
        print(f"features {'reused' if workspace.feature_cache_hit else 'built'}: {workspace.features.directory}")
    return 0


def located_run(args: argparse.Namespace):
    """The run named on the command line, which must hold a checkpoint."""
    from harness.run import Run

    run = Run.locate(args.run, args.workdir)
    if not run.has_checkpoint():
        raise SystemExit(f"error: no checkpoint for run {str(args.run)!r} at {run.checkpoint_path}")
    return run


def cmd_export(args: argparse.Namespace) -> int:
    from harness.export import ExportDestinationError, NoPeerFormat, check_destination, export_checkpoint, peer_format
    from harness.run import EXPORT_DIR
    from harness.train import TrainedRun

    run = located_run(args)
    trained = TrainedRun.load(run)
    config = trained.config
    out = args.out or run.path(EXPORT_DIR)
    try:
        peer_format(config.algorithm.entry)
        check_destination(out, run.workdir, args.force)
    except (NoPeerFormat, ExportDestinationError) as error:
        raise SystemExit(f"error: {error}") from None
    target = trained.load_target()
    out = export_checkpoint(trained.draft(target), out, target.source)
    print(f"exported {config.algorithm.algorithm} draft (step {trained.state['step']}) to {out}")
    print(f"serve with: vllm serve {out}   (verifier: {target.source})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from harness import tracking
    from harness.config import EvalConfig
    from harness.evaluate import evaluate, log_evaluation
    from harness.run import EVAL_RECORDS_FILE
    from harness.train import TrainedRun, prepare_workspace

    engine = served_engine(args)
    if args.prompts is not None:
        from harness.data import read_prompts

        try:
            read_prompts(args.prompts)  # refused before the target and data load
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    run = located_run(args)
    if engine is not None:
        check_served_writable(run)
    trained = TrainedRun.load(run)
    if engine is not None:
        from harness.serving.draft import check_served_format

        check_served_format(trained.config.algorithm.entry)
    workspace = prepare_workspace(trained.config, run.workdir, args.device)
    draft = trained.draft(workspace.target, args.device)
    eval_config = EvalConfig(
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperatures=tuple(args.temperatures),
        confidence_threshold=args.confidence_threshold,
        prompts=None if args.prompts is None else str(args.prompts),
    )
    if engine is not None:
        return evaluate_served(engine, run, workspace, draft, eval_config)
    metrics, records = evaluate(workspace.target, draft, workspace.data.validation, eval_config)
    log_evaluation(run, metrics, records)
    for name in (
        "measured_accepted_length_greedy",
        "measured_accepted_length_greedy_accepted_per_verified",
        "measured_accepted_length_t1",
        "chat_offline_realized_accepted_length",
        "chat_offline_realized_accepted_length_replayed",
        "chat_measured_accepted_length_greedy_pooled",
        "mtbench_offline_realized_accepted_length",
        "mtbench_offline_realized_accepted_length_replayed",
        "mtbench_measured_accepted_length_greedy_pooled",
        "mtbench_lossless_fraction",
        "chat_lossless_fraction",
    ):
        if name in metrics:
            print(f"{tracking.EVAL_PREFIX}{name}: {metrics[name]:.4f}")
    print(f"logged to MLflow run {run.run_id}; per-request records in {run.path(EVAL_RECORDS_FILE)}")
    print(f"MLflow UI: {tracking.run_link(run.workdir, run.run_id)}")
    return 0


def check_served_writable(run) -> None:
    """The folders serving writes into (the run's served files, the work directory's converted target and server
    records) are tried before anything loads: a read-only one is refused in one line, as a read-only work
    directory is."""
    from harness.files import check_writable
    from harness.run import SERVED_DIR, SERVING_LOCK_FILE

    hint = " (make it writable, or serve from a copy of the work directory)"
    for folder, what in [
        (run.path(SERVED_DIR), f"run {run.name}'s served folder"),
        (run.workdir / SERVED_DIR, "the work directory's served folder"),
    ]:
        check_writable(folder, "served folder", what=what, store_files=(SERVING_LOCK_FILE,), hint=hint)


def served_engine(args: argparse.Namespace):
    """The llama.cpp build that `--engine llama.cpp` asks for (None without the flag); missing: one line."""
    if getattr(args, "engine", None) is None:
        return None
    from harness.serving.engine import find_engine

    return find_engine()


def evaluate_served(engine, run, workspace, draft, eval_config) -> int:
    from harness import tracking
    from harness.run import SERVED_RECORDS_FILE
    from harness.serving import metrics as served_names
    from harness.serving.compare import serve_run

    metrics = serve_run(engine, run, workspace.target, draft, workspace.data.validation, eval_config)
    for name in (name for name in served_names.SUMMARY if name in metrics):  # the n-gram types are opt-in
        print(f"{served_names.PREFIX}{name}: {metrics[name]:.4f}")
    print(served_verdict(metrics))
    print(f"llama.cpp {engine.commit[:9]}; per-request records in {run.path(SERVED_RECORDS_FILE)}")
    print(f"MLflow UI: {tracking.run_link(run.workdir, run.run_id)}")
    return 0


def served_verdict(metrics: dict[str, float]) -> str:
    """One line: the served accepted length against the break-even of the draft's shape on this machine."""
    from harness.serving import metrics as served_names
    from harness.serving.break_even import interval_text

    served, needed = metrics[served_names.ACCEPTED_GREEDY], metrics[served_names.BREAK_EVEN]
    if math.isinf(needed):
        return (
            f"served accepted length {served:.2f}: this draft's shape does not pay for itself on this machine even "
            f"when every draft is accepted (a cycle costs {metrics[served_names.CYCLE_COST]:.2f} plain tokens)"
        )
    if served >= needed:
        return f"served accepted length {served:.2f} is above the break-even {needed:.2f}: the draft pays for itself"
    low, high = metrics[served_names.low(served_names.BREAK_EVEN)], metrics[served_names.high(served_names.BREAK_EVEN)]
    return (
        f"served accepted length {served:.2f}; break-even on this machine {interval_text(needed, low, high)}: "
        f"{needed - served:.2f} accepted tokens per cycle short of paying for itself"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a run's draft with its target in llama.cpp for a person to try, until Ctrl-C."""
    from harness.files import file_lock
    from harness.run import SERVED_DIR, SERVING_LOCK_FILE
    from harness.serving.draft import check_servable, check_served_format, served_draft
    from harness.serving.engine import ENGINE, EngineError
    from harness.serving.gguf import target_gguf
    from harness.serving.server import Session, check_port_free
    from harness.train import TrainedRun

    if args.port is not None:
        check_port_free(args.port)  # before anything loads: a taken port is refused, never silently moved
    args.engine = ENGINE
    engine = served_engine(args)
    run = located_run(args)
    check_served_writable(run)
    trained = TrainedRun.load(run)
    check_served_format(trained.config.algorithm.entry)
    target = trained.load_target()
    draft = trained.draft(target)
    check_servable(draft)
    session = Session.of(engine, run.workdir, run.path(SERVED_DIR))
    with file_lock(run.path(SERVED_DIR) / SERVING_LOCK_FILE, f"serving run {run.name}"):
        model, served_as = target_gguf(engine, run.workdir, target), served_draft(engine, run, draft, target)
        with session.server(model, "server", served_as, port=args.port) as server:
            print(f"serving {run.name} with llama.cpp {engine.commit[:9]} at {server.url} (Ctrl-C stops it)")
            print(
                f"try: curl {server.url}/v1/chat/completions -H 'Content-Type: application/json' "
                """-d '{"messages": [{"role": "user", "content": "Write a haiku about the sea."}]}'"""
            )
            status = server.process.wait()  # until Ctrl-C, SIGTERM, or the server's own end
    raise EngineError(
        f"llama-server stopped by itself with status {status}: {server.log_tail()} (log: {server.log_path})"
    )


def add_system_metrics(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--system-metrics",
        action="store_true",
        help="also log CPU/GPU/memory series (system/*) with every run (default: off, they crowd the charts)",
    )


class OneLineParser(argparse.ArgumentParser):
    """Bad command-line input ends in one line naming the argument, its value and what is allowed (argparse
    would print the whole usage first); `--help` still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def installed_version() -> str:
    """The installed package's version (pyproject.toml's), or where a checkout runs without installing it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("dflash-lab")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run bash scripts/setup.sh)"


def build_parser() -> argparse.ArgumentParser:
    from harness.config import EvalConfig

    parser = OneLineParser(prog="dflash-lab", description="Train, compare and ablate DFlash-family draft models.")
    parser.add_argument("--version", action="version", version=f"dflash-lab {installed_version()}")
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
    add_system_metrics(train)
    add_distributed_options(train)
    train.set_defaults(handler=cmd_train, writes=True, on_sigterm=TRAIN_ON_SIGTERM)

    prepare = commands.add_parser(
        "prepare",
        help="regenerate data and build the feature cache ahead of time",
        description="Regenerate responses with the target and extract the shared feature cache.",
    )
    add_common(prepare)
    add_run_options(prepare)
    prepare.add_argument(
        "--dry-run", action="store_true", help="print the feature cache's estimated size against the free disk"
    )
    add_distributed_options(prepare)
    prepare.set_defaults(handler=cmd_prepare, writes=True)

    export = commands.add_parser(
        "export",
        help="write a servable Z Lab / speculators / vLLM checkpoint",
        description="Export a run's last checkpoint in the native layout with a dual config.",
    )
    add_common(export)
    export.add_argument("run", type=Path, help="run directory or run name")
    export.add_argument("--out", type=Path, help="output directory (default: <run>/export)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out that is not a previous export")
    export.set_defaults(handler=cmd_export, writes=True)

    evaluate = commands.add_parser(
        "evaluate",
        help="measure acceptance by real speculative decoding (MT-bench + held-out chat)",
        description="Decode with the target verifying the draft; log measured acceptance beside the offline metrics.",
    )
    add_common(evaluate)
    evaluate.add_argument("run", type=Path, help="run directory or run name")
    defaults = EvalConfig()
    evaluate.add_argument(
        "--num-prompts", type=int, default=defaults.num_prompts, help="prompts per set (default: %(default)s)"
    )
    evaluate.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help='your own prompts in place of MT-bench: a JSONL file of {"prompt": "..."} per line, its first '
        "--num-prompts decoded (default: MT-bench first turns)",
    )
    evaluate.add_argument(
        "--max-new-tokens", type=int, default=defaults.max_new_tokens, help="tokens per request (default: %(default)s)"
    )
    evaluate.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=list(defaults.temperatures),
        help="decoding temperatures (default: %(default)s)",
    )
    evaluate.add_argument(
        "--confidence-threshold",
        type=probability,
        default=defaults.confidence_threshold,
        help="confidence-scheduled verification for a member with a confidence head (DSpark): verify the draft "
        "prefix whose predicted cumulative acceptance is at least this (default: %(default)s, the whole block)",
    )
    from harness.serving.engine import ENGINE

    evaluate.add_argument(
        "--engine",
        choices=[ENGINE],
        help="serve the draft in this engine instead, on the same prompts, and compare cycle by cycle with the "
        "harness's own decoder (served/llama_cpp/*; built by scripts/setup.sh)",
    )
    evaluate.set_defaults(handler=cmd_evaluate, writes=True)

    serve = commands.add_parser(
        "serve",
        help="serve a run's draft with its target in llama.cpp, for a person to try",
        description="Start llama.cpp's llama-server on loopback with the run's draft; Ctrl-C stops it.",
    )
    add_common(serve)
    serve.add_argument("run", type=Path, help="run directory or run name")
    serve.add_argument("--port", type=int, help="port on 127.0.0.1 (default: a free one)")
    serve.set_defaults(handler=cmd_serve, writes=True)

    from reports.cli import add_report_command
    from studies.cli import add_study_command

    add_study_command(commands, add_common)
    add_report_command(commands, add_common)

    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that bad input or an unreachable service causes: shown as one line, not a traceback."""
    from sqlalchemy.exc import OperationalError

    from harness.serving.engine import EngineError

    return (ValueError, LookupError, OSError, OperationalError, EngineError)


class LineTrackingStream:
    """A command's stderr that remembers whether its last write left a line open (a progress bar draws with `\r`
    and no newline), so that an error can start a line of its own even after the bar itself is gone."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.line_open = False

    def write(self, text: str) -> int:
        if text:
            self.line_open = not text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def track_stderr_lines() -> None:
    """Route stderr through a LineTrackingStream before any logger or progress bar takes hold of it."""
    if not isinstance(sys.stderr, LineTrackingStream):
        sys.stderr = LineTrackingStream(sys.stderr)


def print_error(message: str) -> None:
    """Write a command's one-line error on a line of its own.

    An error can leave a progress bar's line unfinished: a Ctrl-C that lands inside tqdm's constructor, after its
    first draw, never enters the `with` block whose exit would end the line. So every bar still open is ended first.
    """
    from tqdm import tqdm

    for bar in list(tqdm._instances):  # tqdm's registry of open bars; the bars of tqdm.auto register there too
        try:
            bar.close()  # redraws the bar and ends its line
        except AttributeError:  # built only up to its first draw: end the line it drew
            if (stream := getattr(bar, "fp", None)) is not None:
                stream.write("\n")
    # A bar interrupted inside its constructor can be collected (and leave tqdm's registry) before this runs: its
    # line is still open on stderr.
    if getattr(sys.stderr, "line_open", False):
        sys.stderr.write("\n")
    print(message, file=sys.stderr)


def check_outputs_writable(args: argparse.Namespace) -> None:
    """A command that writes checks its work directory and stores (and an --out it was given) before it loads a
    target, regenerates data or opens a store: a read-only one fails in one line, at once."""
    if not getattr(args, "writes", False) or getattr(args, "dry_run", False):
        return
    from harness.files import check_writable
    from harness.layout import STORES

    hint = " (pass another --workdir, or make this one writable)"
    check_writable(args.workdir, "--workdir", store_files=STORES, hint=hint)
    if getattr(args, "out", None) is not None:
        check_writable(args.out, "--out", what="the output directory", hint=" (pass another --out)")


TRAIN_ON_SIGTERM = (
    "finished work is kept (regenerated data and features are cached); a run that had started is recorded "
    "interrupted, and `train ... --resume` continues it from its last checkpoint"
)


def sigterm_remedy(args: argparse.Namespace) -> str:
    """What to do after a SIGTERM: the command's own remedy where it has one (train, study launch), else the same
    command again (evaluate, serve, export: each starts over, reusing what it finished and cached)."""
    import shlex

    own = getattr(args, "on_sigterm", None)
    return own or f"finished work is kept; run the same command again: dflash-lab {shlex.join(args.argv)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    track_stderr_lines()
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from harness.preemption import (
        LAUNCHED_RUN_ENV,
        SIGTERM_EXIT,
        Preempted,
        RankStopped,
        exit_quietly_on_sigterm,
        job_stopping,
        stop_on_preemption,
    )

    stop_on_preemption()
    if os.environ.get("RANK", "0") != "0":  # a torchrun rank that owns no run
        exit_quietly_on_sigterm()
    try:
        if not getattr(args, "dry_run", False):  # a dry run touches no device and no store
            check_outputs_writable(args)  # first: before MLflow's import, which alone takes seconds
            from harness import tracking
            from harness.devices import check_device

            check_device(getattr(args, "device", "cpu"))
            tracking.check_reachable(args.workdir)
        return args.handler(args)
    except KeyboardInterrupt as stop:
        if isinstance(stop, Preempted):
            print_error(f"error: terminated (SIGTERM); {sigterm_remedy(args)}")
            return SIGTERM_EXIT
        print_error("error: interrupted (Ctrl-C); finished work is kept and resumes where it stopped")
        return 130
    except RankStopped as stop:  # its run is recorded failed; a dflash-lab launcher speaks for the whole job
        if LAUNCHED_RUN_ENV not in os.environ:
            print_error(f"error: {stop}")
        return SIGTERM_EXIT
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print_error(stop.code)  # the commands' own one-line `error: ...`
        return 2
    except user_errors() as error:
        if args.verbose:
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print_error(f"error: {message}")
        return 2
    except Exception:
        if job_stopping():  # a collective failed because a peer rank was stopped first: the launcher speaks
            return SIGTERM_EXIT
        raise


if __name__ == "__main__":  # how torchrun starts a rank
    from harness.distributed import exit_rank_after

    exit_rank_after(main)
