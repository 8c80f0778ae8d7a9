"""Build a study's report from the tracking store and log it to the study's parent run."""

from __future__ import annotations

from pathlib import Path

from harness import tracking
from reports.analysis import analyse
from reports.collect import collect
from reports.designed import design_metrics
from reports.render import render_comparison, render_with_summary
from reports.sections import headline, leaderboard_frame

LEADERBOARD_TABLE = "report/leaderboard.json"


def report_root(workdir: Path) -> Path:
    """Where reports go unless told otherwise: inside the work directory, like everything a command writes."""
    return workdir / "reports"


def build_report(study: str, workdir: Path, out_root: Path | None = None) -> Path:
    """Write <out_root>/<study>/README.md plus its PNGs, and log them as parent-run artifacts."""
    return build_report_with_summary(study, workdir, out_root)[0]


def build_report_with_summary(study: str, workdir: Path, out_root: Path | None = None) -> tuple[Path, list[str]]:
    """`build_report`, and the report's verdict lines (what a launch ends on): the markdown, the parent run's
    table, note, design metrics and transfer tags all come from one analysis of the study."""
    analysis = analyse(collect(study, workdir))
    out_dir = (out_root or report_root(workdir)) / study
    client = tracking.client(workdir)
    parent = analysis.whole.parent["run_id"]
    markdown, summary = render_with_summary(
        analysis, out_dir, lambda name, figure: client.log_figure(parent, figure, f"report/{name}")
    )
    path = out_dir / "README.md"
    path.write_text(markdown)
    client.log_artifact(parent, str(path), artifact_path="report")
    client.log_table(parent, leaderboard_frame(analysis.configs), LEADERBOARD_TABLE)
    client.set_tag(parent, tracking.TAG_NOTE, headline(analysis.configs))
    logged = tracking.ChangedMetrics(client, parent)
    for key, value in design_metrics(analysis).items():  # a rebuilt report adds no rows
        logged.log(key, value)
    labels = analysis.design.transfer_labels() if analysis.design else {}
    for key, value in labels.items():  # how each verdict carried to a longer budget
        client.set_tag(parent, tracking.transfer_tag(key), value)
    return path, summary


def build_comparison(first: str, second: str, workdir: Path, out_root: Path | None = None) -> Path:
    markdown = render_comparison(collect(first, workdir), collect(second, workdir))
    path = (out_root or report_root(workdir)) / f"compare-{first}-vs-{second}" / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown)
    return path
