"""A run's draft as llama.cpp serves it: refused up front when the engine cannot serve it, converted to GGUF once
per checkpoint, and carried as one value (`ServedDraft`) with the shape the engine drafts with."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from algorithms.dflash import DFlashDraft
from algorithms.registry import Algorithm
from harness.data import Document
from harness.export import NoPeerFormat, export_checkpoint, peer_format
from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, Run
from harness.serving.engine import ENGINE, Engine, EngineError
from harness.serving.gguf import gguf_problem, target_gguf, to_gguf, with_reduced_vocabulary
from harness.targets import Target


@dataclass(frozen=True)
class ServedDraft:
    """The GGUF of a run's draft, the tokens it drafts per cycle and llama.cpp's speculative type for it."""

    name: str  # the run's
    algorithm: str
    gguf: Path
    block: int  # drafted tokens per cycle: the block less its first slot when that holds the verified token
    spec_type: str
    layers: int  # the draft's decoder layers: a deeper draft's cycle costs more
    vocabulary: int | None = None  # drafts over this many tokens only (a d2t map); None: the whole vocabulary
    # llama.cpp's --spec-draft-p-min: a cycle's draft ends at its first token less confident than this, and a
    # cycle left with none decodes one plain token (0: every cycle drafts the whole block)
    confidence_cut: float = 0.0

    @property
    def label(self) -> str:
        return f"`{self.name}` ({self.algorithm}, block {self.block + 1}, {self.layers} layer{'s' * (self.layers > 1)})"

    @property
    def shape(self) -> tuple[int, str, int, int | None]:
        """What the break-even depends on: synthetic acceptance times the shape (its depth and the head's size),
        not the weights."""
        return self.block, self.spec_type, self.layers, self.vocabulary


def served_draft(engine: Engine, run: Run, draft: DFlashDraft, target: Target) -> ServedDraft:
    """The run's draft, checked and converted (once per run checkpoint)."""
    check_servable(draft)
    return ServedDraft(
        run.name, draft.algorithm.entry.name, draft_gguf(engine, run, draft, target), *served_shape(draft)
    )


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


def served_shape(draft: DFlashDraft) -> tuple[int, str, int]:
    """What llama.cpp serves the draft as: tokens drafted per cycle, its speculative type and its layers."""
    shared = draft.shared
    return (
        draft.block_size - shared.first_draft_slot,
        draft.algorithm.entry.export_format.serve_as,
        shared.num_draft_layers,
    )


def draft_gguf(engine: Engine, run: Run, draft: DFlashDraft, target: Target) -> Path:
    """The run's draft as f32 GGUF, converted once per run checkpoint."""
    export = run.path(SERVED_DIR) / "export"
    if not (export / "config.json").is_file():
        export_checkpoint(draft, export, target.source)
    return to_gguf(engine, export, run.path(SERVED_DIR) / DRAFT_GGUF_FILE, f"run {run.name}", Path(target.source))


def frequent_tokens(documents: Sequence[Document], size: int, always: tuple[int, ...] = ()) -> list[int]:
    """The `size` token ids the target writes most often in `documents`' supervised positions (its replies), most
    frequent first, with `always` (the end-of-turn tokens) among them; ties by id."""
    counts = Counter(t for d in documents for t, kept in zip(d.input_ids, d.loss_mask, strict=True) if kept)
    chosen = list(dict.fromkeys([*always, *sorted(counts, key=lambda t: (-counts[t], t))]))[:size]
    if len(chosen) < size:
        raise EngineError(
            f"invalid vocabulary size={size}: the run's replies hold {len(chosen)} distinct tokens; allowed at most "
            f"{len(chosen)}"
        )
    return chosen


def reduced_vocabulary(target: Target, documents: Sequence[Document], size: int) -> list[int]:
    """The token ids a draft reduced to `size` drafts over: its training replies' most frequent, end-of-turn and
    padding tokens always among them."""
    special = tuple(t for t in (target.tokenizer.eos_token_id, target.tokenizer.pad_token_id) if t is not None)
    return frequent_tokens(documents, size, special)


def reduced_draft(
    engine: Engine, run: Run, served: ServedDraft, target: Target, documents: Sequence[Document], size: int
) -> ServedDraft:
    """The served draft drafting over the `size` tokens its training replies use most (the head's other rows
    dropped, a `d2t` map added), written once per size beside the run's draft GGUF."""
    out = served.gguf.with_name(f"{served.gguf.stem}-vocab{size}.gguf")
    if not out.is_file() or gguf_problem(out) is not None:
        ids = reduced_vocabulary(target, documents, size)
        with_reduced_vocabulary(served.gguf, target_gguf(engine, run.workdir, target), ids, out)
    return dataclasses.replace(served, name=f"{served.name} (vocabulary {size})", gguf=out, vocabulary=size)
