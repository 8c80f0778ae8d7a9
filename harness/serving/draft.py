"""A run's draft as llama.cpp serves it: refused up front when the engine cannot serve it, converted to GGUF once
per checkpoint, and carried as one value (`ServedDraft`) with the shape the engine drafts with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from algorithms.dflash import DFlashDraft
from algorithms.registry import Algorithm
from harness.export import NoPeerFormat, export_checkpoint, peer_format
from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, Run
from harness.serving.engine import ENGINE, Engine, EngineError
from harness.serving.gguf import to_gguf
from harness.targets import Target


@dataclass(frozen=True)
class ServedDraft:
    """The GGUF of a run's draft, the tokens it drafts per cycle and llama.cpp's speculative type for it."""

    name: str  # the run's
    algorithm: str
    gguf: Path
    block: int  # drafted tokens per cycle: the block less its first slot when that holds the verified token
    spec_type: str

    @property
    def label(self) -> str:
        return f"`{self.name}` ({self.algorithm}, block {self.block + 1})"

    @property
    def shape(self) -> tuple[int, str]:
        """What the break-even depends on: synthetic acceptance times the shape, not the weights."""
        return self.block, self.spec_type


def served_draft(engine: Engine, run: Run, draft: DFlashDraft, target: Target) -> ServedDraft:
    """The run's draft, checked and converted (once per run checkpoint)."""
    check_servable(draft)
    block, spec_type = served_shape(draft)
    return ServedDraft(run.name, draft.algorithm.entry.name, draft_gguf(engine, run, draft, target), block, spec_type)


def check_served_format(entry: Algorithm) -> None:
    """A member with no export format cannot be served: refused from the run's config, before the target loads."""
    try:
        peer_format(entry)
    except NoPeerFormat as error:
        raise EngineError(f"invalid --engine={ENGINE} for run of {entry.name}: {error}") from None


def check_servable(draft: DFlashDraft) -> None:
    """Refuse, in one line and before any work, what llama.cpp cannot serve."""
    entry = draft.algorithm.entry
    check_served_format(entry)
    top_k, hidden = draft.shared.candidate_top_k, draft.config.target.hidden_size
    if entry.has_selector and hidden < top_k * (top_k + 1):
        raise EngineError(
            f"invalid --engine={ENGINE} for this {entry.name} run: its selector lattice needs hidden_size >= "
            f"top_k * (top_k + 1) = {top_k * (top_k + 1)} in llama.cpp, the target has {hidden}; allowed "
            f"candidate_top_k <= {int((math.sqrt(4 * hidden + 1) - 1) / 2)}"
        )


def served_shape(draft: DFlashDraft) -> tuple[int, str]:
    """What llama.cpp serves the draft as: tokens drafted per cycle, and its speculative type."""
    return draft.block_size - draft.shared.first_draft_slot, draft.algorithm.entry.export_format.serve_as


def draft_gguf(engine: Engine, run: Run, draft: DFlashDraft, target: Target) -> Path:
    """The run's draft as f32 GGUF, converted once per run checkpoint."""
    export = run.path(SERVED_DIR) / "export"
    if not (export / "config.json").is_file():
        export_checkpoint(draft, export, target.source)
    return to_gguf(engine, export, run.path(SERVED_DIR) / DRAFT_GGUF_FILE, f"run {run.name}", Path(target.source))
