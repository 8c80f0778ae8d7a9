"""Pure-torch DFlash-family draft algorithms: models, losses and metrics (no I/O)."""

from algorithms.knobs import ConvKnobs, DFlash2Knobs, DFlashKnobs, SelectorKnobs, SharedKnobs
from algorithms.modeling import TargetLayers, TargetSpec
from algorithms.registry import ALGORITHMS, Algorithm, AlgorithmConfig, algorithm_entry, build_draft

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "ConvKnobs",
    "DFlash2Knobs",
    "DFlashKnobs",
    "SelectorKnobs",
    "SharedKnobs",
    "TargetLayers",
    "TargetSpec",
    "algorithm_entry",
    "build_draft",
]
