"""`dflash-lab report <study>` and `dflash-lab report --compare A B`."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    from harness import tracking
    from reports.build import build_comparison, build_report

    if not (args.compare or args.study):
        raise SystemExit("error: name a study, or pass --compare STUDY_A STUDY_B")
    store = tracking.local_store(args.workdir)
    if store is not None and not store.exists():  # answered without creating an empty store
        name = (args.compare or [args.study])[0]
        raise SystemExit(f"error: no study named {name!r}: {args.workdir} holds no tracking store yet")
    try:
        if args.compare:
            path = build_comparison(args.compare[0], args.compare[1], args.workdir, args.out)
        else:
            path = build_report(args.study, args.workdir, args.out)
    except LookupError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Report: {path}")
    if not args.compare:  # the report and its figures were logged to the study's parent run
        print(tracking.ui_hint(args.workdir, tracking.experiment_name(args.study)))
    return 0


def add_report_command(commands, add_common) -> None:
    report = commands.add_parser(
        "report",
        help="markdown ablation report from what MLflow recorded",
        description="Write <workdir>/reports/<study>/README.md and figures from the tracking store alone.",
    )
    add_common(report)
    report.add_argument("study", nargs="?", help="study name")
    report.add_argument("--compare", nargs=2, metavar=("STUDY_A", "STUDY_B"), help="two studies side by side")
    report.add_argument("--out", type=Path, help="output root (default: <workdir>/reports)")
    # writes: the report's files, and the report and figures logged to the study's parent run
    report.set_defaults(handler=cmd_report, writes=True)
