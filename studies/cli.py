"""`dflash-lab study launch|status|list`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_launch(args: argparse.Namespace) -> int:
    from harness import tracking
    from studies.runner import launch
    from studies.schema import StudyDefinitionError, load_study

    try:
        definition = load_study(args.file)
    except (FileNotFoundError, StudyDefinitionError) as error:
        raise SystemExit(f"error: {error}") from None
    args.n_jobs = resolve_n_jobs(args.n_jobs, args.device)
    if definition.served_objectives and args.n_jobs > 1:
        raise SystemExit(
            f"error: invalid --n-jobs={args.n_jobs} for study {definition.name}: its objective "
            f"{definition.objectives} times decoding, which a trial training beside it would slow; allowed 1"
        )
    devices = parse_devices(args.devices, args.n_jobs) if args.devices else None
    summary = launch(
        definition,
        args.file,
        args.workdir,
        args.storage,
        args.device,
        args.n_jobs,
        args.worker,
        system_metrics=args.system_metrics,
        devices=devices,
    )
    if args.worker:
        return 0
    print(json.dumps(summary, indent=2, default=str))
    if not args.no_report:  # the last lines: the answer, where it is written, how to look, how to rebuild
        from reports.build import build_report_with_summary

        report, verdicts = build_report_with_summary(definition.name, args.workdir)
        print("\n".join(["", f"Verdicts of study {definition.name}:", *verdicts, ""]))
        print(f"Report: {report}")
    print(tracking.ui_hint(args.workdir, tracking.experiment_name(definition.name)))
    print(f"Regenerate the report any time with: dflash-lab report {definition.name} --workdir {args.workdir}")
    if failed := summary.get("failed_trials"):
        number, reason = next(iter(failed.items()))
        total = sum(summary["trials"].values())
        raise SystemExit(
            f"error: {len(failed)} of {total} trials of study {definition.name} failed (trial {number}: "
            f"{reason.splitlines()[0] if reason else 'no reason'}); `dflash-lab study status {definition.name}` "
            "lists them with their reasons"
        )
    return 0


AUTO_CPU_JOBS = 2  # the layout measured faster on the 2-core machine (README: "Runs per hour")


def resolve_n_jobs(text: str, device: str, cores: int | None = None) -> int:
    """`--n-jobs`: an integer >= 1, or auto (two one-thread workers on a CPU with at least two cores)."""
    import os

    if text == "auto":
        cores = cores if cores is not None else (os.cpu_count() or 1)
        return AUTO_CPU_JOBS if device == "cpu" and cores >= AUTO_CPU_JOBS else 1
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"error: invalid --n-jobs={text}: allowed an integer >= 1 or auto")
    return int(text)


def parse_devices(text: str, n_jobs: int) -> list[str]:
    """`cuda:0,cuda:1,...`: one worker per device, each checked to exist here."""
    from harness.devices import check_device

    devices = [item.strip() for item in text.split(",") if item.strip()]
    if not devices:
        raise SystemExit(f"error: invalid --devices={text!r}: allowed a comma-separated list like cuda:0,cuda:1")
    if n_jobs > 1:
        raise SystemExit(
            f"error: invalid --n-jobs={n_jobs} with --devices={text!r}: allowed one of them "
            "(--devices starts one worker per listed device)"
        )
    for device in devices:
        check_device(device)
    return devices


def cmd_schema(args: argparse.Namespace) -> int:
    from studies.schema import study_json_schema

    print(json.dumps(study_json_schema(), indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import optuna

    from studies.storage import (
        ATTR_FAIL_REASON,
        ATTR_INFEASIBLE,
        ATTR_INTERRUPTED,
        ATTR_PRUNED,
        ATTR_RUN_ID,
        missing_local_storage,
        storage_url,
    )

    if missing_local_storage(args.workdir, args.storage):
        raise SystemExit(f"error: no study named {args.name!r}: {args.workdir} holds no study storage yet")
    try:
        study = optuna.load_study(study_name=args.name, storage=storage_url(args.workdir, args.storage))
    except KeyError:
        raise SystemExit(
            f"error: no study named {args.name!r} in "
            f"{storage_url(args.workdir, args.storage)}; see `dflash-lab study list`"
        ) from None
    print(f"study {study.study_name}: directions {[d.name.lower() for d in study.directions]}")
    print(f"{'trial':>5}  {'state':9}  {'value':>8}  params / reason")
    interrupted = set(study.user_attrs.get(ATTR_INTERRUPTED, []))
    for trial in study.get_trials(deepcopy=False):
        value = "" if trial.values is None else ",".join(f"{v:.3f}" for v in trial.values)
        reason = (
            trial.user_attrs.get(ATTR_INFEASIBLE)
            or trial.user_attrs.get(ATTR_PRUNED)
            or trial.user_attrs.get(ATTR_FAIL_REASON)
            or (
                "interrupted: its worker stopped sending heartbeats; the same knobs were re-queued"
                if trial.number in interrupted
                else ""
            )
        )
        run = trial.user_attrs.get(ATTR_RUN_ID, "")
        run = f"mlflow {run}" if run else ""
        print(f"{trial.number:>5}  {trial.state.name:9}  {value:>8}  {trial.params} {reason} {run}".rstrip())
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    import optuna

    from studies.storage import missing_local_storage, storage_url

    url = storage_url(args.workdir, args.storage)
    summaries = [] if missing_local_storage(args.workdir, args.storage) else optuna.get_all_study_summaries(url)
    if not summaries:
        print(f"no studies in {url}")
    for summary in summaries:
        best = "" if summary.best_trial is None else f" best {summary.best_trial.values}"
        started = summary.datetime_start.strftime("%Y-%m-%d %H:%M") if summary.datetime_start else "-"
        print(f"{summary.study_name}: {summary.n_trials} trials, started {started}{best}")
    return 0


def add_study_command(commands, add_common) -> None:
    study = commands.add_parser(
        "study",
        help="launch and inspect Optuna ablation studies",
        description="Optuna ablation studies over DFlash2's conv and selector knobs.",
    )
    sub = study.add_subparsers(dest="study_command", required=True)

    launch = sub.add_parser(
        "launch",
        help="create or resume a study from its YAML file",
        description="Create or resume a study, run its baselines and trials, and write the report.",
    )
    add_common(launch)
    launch.add_argument("file", type=Path, help="study definition (YAML), e.g. studies/default.yaml")
    launch.add_argument(
        "--storage", help="Optuna storage URL (default: sqlite in the workdir; postgresql://... for many workers)"
    )
    launch.add_argument(
        "--n-jobs",
        default="1",
        help="worker processes on this machine, or auto: on a CPU with 2+ cores, 2 workers of one thread each "
        "(1.6x the runs per hour of one 2-thread worker on the 2-core machine, README), else 1 (default: 1)",
    )
    launch.add_argument(
        "--devices",
        help="one worker per device, e.g. cuda:0,cuda:1 (each pinned with its own CUDA_VISIBLE_DEVICES); "
        "overrides --device",
    )
    launch.add_argument(
        "--worker", action="store_true", help="join an existing study as an extra worker (no baselines, no report)"
    )
    launch.add_argument("--no-report", action="store_true", help="skip the markdown report at the end")
    launch.add_argument(
        "--system-metrics", action="store_true", help="also log CPU/GPU/memory series (system/*) with every run"
    )
    launch.set_defaults(
        handler=cmd_launch,
        writes=True,
        on_sigterm="the running trial's run is recorded interrupted, and launching the study again resumes it",
    )

    status = sub.add_parser("status", help="trials of one study with states, values and reasons")
    add_common(status)
    status.add_argument("name", help="study name")
    status.add_argument("--storage", help="Optuna storage URL (default: sqlite in the workdir)")
    status.set_defaults(handler=cmd_status)

    listing = sub.add_parser("list", help="every study in the storage")
    add_common(listing)
    listing.add_argument("--storage", help="Optuna storage URL (default: sqlite in the workdir)")
    listing.set_defaults(handler=cmd_list)

    schema = sub.add_parser(
        "schema",
        help="print the study file's JSON Schema (for editors)",
        description="Print the JSON Schema of a study file, for editors that validate and complete YAML.",
    )
    # touches no device and no store, as a dry run does
    schema.set_defaults(handler=cmd_schema, verbose=False, dry_run=True)
