"""Named run presets: visible knob values, recorded with every run (never hidden branches)."""

from __future__ import annotations

from typing import Any

from algorithms import AlgorithmConfig
from harness.config import RunConfig, TrainConfig
from harness.data import DataConfig

PRESETS = ("small", "published")


def preset_run(preset: str, algorithm: str, target: str) -> RunConfig:
    """`published`: spec §7 defaults. `small`: sized for the embedded target on a 2-core CPU.

    `small` pins the same shared knobs for dflash and dflash2, so their runs compare like for like.
    """
    if preset == "published":
        return RunConfig(AlgorithmConfig.preset(algorithm), TrainConfig(), DataConfig(), target)
    if preset != "small":
        raise ValueError(f"invalid knob preset={preset!r}: allowed one of {list(PRESETS)}")
    shared: dict[str, Any] = dict(
        block_size=8,
        num_draft_layers=2,
        loss="kl_div",
        position_weighting="fixed-exp-decay",
        max_anchors=32,
        block_attention="bidirectional",
        sample_from_anchor=False,
    )
    knobs: dict[str, Any] = (
        dict(selector_rank=64, selector_top_k=16) if algorithm == "dflash2" else dict(metrics_top_k=16)
    )
    return RunConfig(
        AlgorithmConfig.preset(algorithm, **shared, **knobs),
        TrainConfig(
            max_steps=300, learning_rate=3e-3, warmup_ratio=0.03, eval_every=50, checkpoint_every=50, log_every=10
        ),
        DataConfig(num_conversations=240, num_validation=24, max_new_tokens=96, row_length=1024, max_length=256),
        target,
    )
