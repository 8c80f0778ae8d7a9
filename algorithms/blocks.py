"""Anchored blocks on one packed row: anchor sampling, flattening, masks and target indices."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRow:
    """One packed training row. All tensors are [T] except the features."""

    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] 0/1
    document_ids: torch.Tensor  # [T] long, -1 on padding
    position_ids: torch.Tensor  # [T] long, restarts at 0 per document
    features: torch.Tensor  # [T, n_T*H] concatenated target hidden states
    target_hidden: torch.Tensor  # [T, H] target final (post-norm) hidden state

    @property
    def length(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> PackedRow:
        return PackedRow(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


@dataclass
class Anchors:
    """N anchor positions (sorted, padded with position 0) and which of them are real."""

    positions: torch.Tensor  # [N] long
    valid: torch.Tensor  # [N] bool
    # (document start, position, valid) per anchor as Python lists, when the anchors were drawn on the host:
    # the attention tiles are sliced by them, so a forward on an accelerator never reads them back.
    host: tuple[list[int], list[int], list[bool]] | None = None

    def strided(self, start: int, step: int) -> Anchors:
        """Every `step`-th anchor from `start`: one data-parallel rank's disjoint, still sorted, part."""
        host = None if self.host is None else tuple(values[start::step] for values in self.host)
        return Anchors(self.positions[start::step], self.valid[start::step], host)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """The first position of each position's document (documents are contiguous in a packed row)."""
    length = document_ids.shape[0]
    index = torch.arange(length, device=document_ids.device)
    is_start = torch.ones(length, dtype=torch.bool, device=document_ids.device)
    is_start[1:] = document_ids[1:] != document_ids[:-1]
    return torch.cummax(torch.where(is_start, index, 0), dim=0).values


def host_view(anchors: Anchors, document_ids: torch.Tensor) -> tuple[list[int], list[int], list[bool]]:
    """What the tiling needs on the host; free where the tensors live on the CPU."""
    if anchors.host is not None:
        return anchors.host
    starts = document_starts(document_ids)[anchors.positions]
    return starts.tolist(), anchors.positions.tolist(), anchors.valid.tolist()


def eligible_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions whose whole block lies inside their own document (none crosses one) and that carry loss."""
    length = loss_mask.shape[0]
    eligible = loss_mask.bool() & (document_ids != -1)
    last = torch.arange(length, device=loss_mask.device) + block_size - 1
    in_row = last <= length - 1
    end_doc = document_ids[last.clamp(max=length - 1)]
    return eligible & in_row & (end_doc == document_ids)


def sample_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> Anchors:
    """Draw min(N, |E|) eligible anchors uniformly without replacement, sorted ascending."""
    eligible = torch.nonzero(eligible_anchor_mask(loss_mask, document_ids, block_size)).squeeze(-1)
    count = min(max_anchors, eligible.numel())
    perm = torch.randperm(eligible.numel(), generator=generator, device="cpu").to(eligible.device)
    positions = torch.zeros(max_anchors, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(max_anchors, dtype=torch.bool, device=loss_mask.device)
    positions[:count] = eligible[perm[:count]].sort().values
    valid[:count] = True
    return Anchors(positions, valid)


def block_indices(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat row index of every block slot: idx[j*B + k] = a_j + k."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions[:, None] + offsets[None, :]).reshape(-1)


def draft_slots(flat: torch.Tensor, block_size: int, first_slot: int) -> torch.Tensor:
    """Per-row values [M, ...] (M = N blocks x B slots) as [N, S, ...] over the draft slots first_slot .. B-1."""
    return flat.view(-1, block_size, *flat.shape[1:])[:, first_slot:]


def target_indices(
    anchor_positions: torch.Tensor, block_size: int, length: int, sample_from_anchor: bool
) -> torch.Tensor:
    """Row whose target logits supervise each flat slot; wraps only at masked slot 0."""
    idx = block_indices(anchor_positions, block_size)
    return idx if sample_from_anchor else (idx - 1) % length


@dataclass(frozen=True)
class LabelRule:
    """Which token each block slot is trained on, and which slots carry loss.

    Slot k of anchor a is trained on token a + k + offset (offset 1: labels shifted, the draft predicts from the
    anchor slot on), and is gated by that label's own loss mask; a label past the row or outside the anchor's
    document is dropped. Slots before `first_slot` never carry loss. With `contiguous`, a block keeps only its
    leading run of supervised slots (DSpark's rule).
    """

    offset: int
    first_slot: int
    contiguous: bool = False


def aligned_loss_mask(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, anchors: Anchors, block_size: int, rule: LabelRule
) -> torch.Tensor:
    """m[jB+k] = valid_j * [k >= first_slot] * loss_mask[l] * [l < T] * [doc(l) = doc(a_j)], l = a_j + k + offset,
    as float [M]; with `rule.contiguous` each block is cut at its first unsupervised slot."""
    length = loss_mask.shape[0]
    labels = block_indices(anchors.positions, block_size) + rule.offset
    in_row = labels < length
    safe = labels.clamp(max=length - 1)
    anchor_doc = document_ids[anchors.positions].repeat_interleave(block_size)
    supervised = in_row & (document_ids[safe] == anchor_doc) & (loss_mask[safe] > 0)
    supervised = supervised.view(-1, block_size) & anchors.valid[:, None]
    supervised[:, : rule.first_slot] = False
    if rule.contiguous:
        supervised[:, rule.first_slot :] = supervised[:, rule.first_slot :].long().cumprod(dim=-1).bool()
    return supervised.view(-1).float()


@dataclass
class AttentionTile:
    """A block-sparse attention tile: consecutive query rows and the context span any of them can see."""

    queries: slice  # rows of the flattened block axis
    context: slice  # context positions
    mask: torch.Tensor  # [queries, context + queries] bool: context keys, then the tile's own block keys


def _tile_mask(
    anchor_positions: torch.Tensor,  # [n] the tile's anchors
    anchor_valid: torch.Tensor,  # [n]
    document_ids: torch.Tensor,  # [T]
    context: slice,
    block_size: int,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """Context of the anchor's document strictly before it (within the window), plus its own block."""
    device = document_ids.device
    query_anchor = anchor_positions.repeat_interleave(block_size)
    query_doc = document_ids[query_anchor]
    ctx = torch.arange(context.start, context.stop, device=device)
    context_visible = (
        (query_doc[:, None] != -1)
        & (document_ids[context][None, :] == query_doc[:, None])
        & (ctx[None, :] < query_anchor[:, None])
    )
    if sliding_window is not None:
        context_visible &= ctx[None, :] >= query_anchor[:, None] - sliding_window
    # Padding anchors see only their own block, so no softmax row is ever empty.
    context_visible &= anchor_valid.repeat_interleave(block_size)[:, None]
    flat = torch.arange(anchor_positions.shape[0] * block_size, device=device)
    block_visible = (flat[:, None] // block_size) == (flat[None, :] // block_size)
    if causal:
        block_visible &= flat[None, :] <= flat[:, None]
    return torch.cat([context_visible, block_visible], dim=1)


def block_attention_mask(
    anchors: Anchors,
    document_ids: torch.Tensor,
    block_size: int,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """Dense boolean mask [M, T+M]: context of the anchor's document strictly before it, plus its own block."""
    return _tile_mask(
        anchors.positions,
        anchors.valid,
        document_ids,
        slice(0, document_ids.shape[0]),
        block_size,
        causal,
        sliding_window,
    )


def attention_tiles(
    anchors: Anchors,
    document_ids: torch.Tensor,
    block_size: int,
    causal: bool,
    sliding_window: int | None,
    blocks_per_tile: int,
) -> list[AttentionTile]:
    """The dense mask as tiles of `blocks_per_tile` blocks, each keeping only the context span it can see.

    Blocks never see each other, and a tile's queries see at most from the earliest document start (or
    window edge) of its anchors up to its last anchor, so most of the dense [M, T+M] mask is never built.
    Documents are contiguous in a packed row.
    """
    length = document_ids.shape[0]
    starts, positions, valid = host_view(anchors, document_ids)
    window = sliding_window if sliding_window is not None else length
    bounds = list(zip(starts, positions, valid, strict=True))
    lowest = [max(start, position - window) if real else length for start, position, real in bounds]
    highest = [position if real else 0 for _, position, real in bounds]
    tiles = []
    for first in range(0, anchors.positions.shape[0], blocks_per_tile):
        last = min(first + blocks_per_tile, anchors.positions.shape[0])
        start, stop = min(lowest[first:last]), max(highest[first:last])
        context = slice(start, stop) if start < stop else slice(0, 0)
        mask = _tile_mask(
            anchors.positions[first:last],
            anchors.valid[first:last],
            document_ids,
            context,
            block_size,
            causal,
            sliding_window,
        )
        tiles.append(AttentionTile(slice(first * block_size, last * block_size), context, mask))
    return tiles
