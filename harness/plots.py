"""Figures a run logs about itself (study-level figures belong to `reports`)."""

from __future__ import annotations

from algorithms.metrics import PATHS


def per_position_figure(rows: list[dict], title: str):
    """Each path's conditional acceptance per draft slot, with its 95% Wilson interval and anchor count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 3.6))
    for offset, path in zip((-0.1, 0.0, 0.1), PATHS, strict=True):
        shown = [r for r in rows if r[f"{path}_n"] > 0]
        xs = [r["slot"] + offset for r in shown]
        ys = [r[f"{path}_conditional_acc"] for r in shown]
        errors = [
            [y - r[f"{path}_low"] for y, r in zip(ys, shown, strict=True)],
            [r[f"{path}_high"] - y for y, r in zip(ys, shown, strict=True)],
        ]
        axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=2, label=path)
    axis.set_xticks([r["slot"] for r in rows], [f"{r['slot']}\nn={r['anchors']}" for r in rows], fontsize=7)
    axis.set_xlabel("draft position (anchors reaching it)")
    axis.set_ylabel("conditional acceptance (95% Wilson)")
    axis.set_ylim(0, 1.02)
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)
    fig.tight_layout()
    return fig
