"""Named run presets: visible knob values, recorded with every run (never hidden branches)."""

from __future__ import annotations

from algorithms import AlgorithmConfig, algorithm_entry
from harness.config import RunConfig, TrainConfig
from harness.data import DataConfig

PRESETS = ("small", "published")

# `small` pins the same shared knobs for every algorithm, so their runs compare like for like; a member's
# defining shared knobs (its registry row's `defining_shared`, e.g. JetSpec's causal blocks) are kept.
SMALL_SHARED = dict(
    block_size=8,
    num_draft_layers=2,
    loss="kl_div",
    position_weighting="fixed-exp-decay",
    max_anchors=32,
    block_attention="bidirectional",
    sample_from_anchor=False,
    candidate_top_k=16,
)
# Applied to the algorithms that have these knobs.
SMALL_KNOBS = dict(selector_rank=64, domino_rank=64, domino_gru_size=256, markov_rank=64)


def preset_run(preset: str, algorithm: str, target: str) -> RunConfig:
    """`published`: the published defaults. `small`: sized for the embedded target on a 2-core CPU."""
    if preset == "published":
        return RunConfig(AlgorithmConfig.preset(algorithm), TrainConfig(), DataConfig(), target)
    if preset != "small":
        raise ValueError(f"invalid knob preset={preset!r}: allowed one of {list(PRESETS)}")
    config = AlgorithmConfig.preset(algorithm, **{**SMALL_SHARED, **algorithm_entry(algorithm).defining_shared})
    config = config.replace(**{k: v for k, v in SMALL_KNOBS.items() if k in config.knob_names()})
    return RunConfig(
        config,
        TrainConfig(
            max_steps=300, learning_rate=3e-3, warmup_ratio=0.03, eval_every=50, checkpoint_every=50, log_every=10
        ),
        DataConfig(num_conversations=240, num_validation=24, max_new_tokens=96, row_length=1024, max_length=256),
        target,
    )
