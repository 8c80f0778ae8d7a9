"""Pure-torch DFlash-family draft algorithms: models, losses and metrics (no I/O)."""

from algorithms.knobs import AlgorithmConfig, DFlash2Knobs, DFlashKnobs, SharedKnobs
from algorithms.modeling import TargetSpec
from algorithms.registry import DRAFT_CLASSES, build_draft

__all__ = [
    "AlgorithmConfig",
    "DFlash2Knobs",
    "DFlashKnobs",
    "SharedKnobs",
    "TargetSpec",
    "DRAFT_CLASSES",
    "build_draft",
]
