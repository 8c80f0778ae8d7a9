"""Target features, extracted once and shared: keyed, atomic, checksummed safetensors shards."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from algorithms.blocks import PackedRow
from harness.data import Document, pack_documents, pack_row, stable_hash
from harness.devices import autocast, computes_in, dtype_name, ids_on, is_accelerator, model_device
from harness.distributed import SINGLE, Ranks
from harness.files import atomic_write, file_sha256

log = logging.getLogger(__name__)
DOCS_PER_SHARD = 64
FEATURE_DTYPE = torch.bfloat16  # per token, the selected layers
# The final hidden state keeps fp32 unless the target itself is bf16, which has no more bits to keep.
FINAL_DTYPES = {"bfloat16": torch.bfloat16}
# The `train.feature_precision` knob. `device` (the default): bf16 on an accelerator and fp32 on every CPU, native
# bf16 or not, so that one cache holds the same features on every CPU. `auto`: bf16 also on a CPU with native bf16,
# where its matmuls are several times faster. `bf16` and `fp32` ask for one everywhere.
DEVICE_PRECISION = "device"
FEATURE_PRECISIONS = (DEVICE_PRECISION, "auto", "bf16", "fp32")


def final_dtype(target_dtype: str) -> torch.dtype:
    """How the cache stores the final hidden state of a target whose own weights are `target_dtype`."""
    return FINAL_DTYPES.get(target_dtype, torch.float32)


class CorruptFeatureCache(RuntimeError):
    """A shard's size or checksum disagrees with the manifest written after it."""


@dataclass
class FeatureCache:
    """Per-document target features ([L, n_T*H] bf16) and final hidden states ([L, H] fp32, or bf16 for a bf16
    target) on disk."""

    directory: Path
    manifest: dict

    @property
    def layer_ids(self) -> list[int]:
        return self.manifest["layer_ids"]

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.manifest["documents"][index]
        with safe_open(self.directory / self.manifest["shards"][shard]["file"], framework="pt") as handle:
            return handle.get_tensor(f"doc{index}.features"), handle.get_tensor(f"doc{index}.final")


class FeatureSource(Protocol):
    """Where a document's target features come from: the cache on disk, or the target itself."""

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class OnlineFeatures:
    """The features the cache would hold, computed by the frozen target when a row needs them (`online`
    mode): nothing is written to disk, for runs whose cache would not fit."""

    target: object
    documents: list[Document]
    layer_ids: list[int]
    precision: str = DEVICE_PRECISION

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.target.model
        with torch.no_grad(), target_precision(model, self.precision):
            out = hidden_states_of(model, ids_on(self.documents[index].input_ids, model_device(model)))
        features = target_features(out.hidden_states, self.layer_ids)[0]
        return stored(features, out.hidden_states[-1][0], final_dtype(self.target.dtype))


def hidden_states_of(model: torch.nn.Module, input_ids: torch.Tensor):
    """The target's hidden states ([0] embeddings ... [n] after the final norm) from its decoder alone: the LM head
    over the whole vocabulary (a fifth of SmolLM2-135M's compute per token, and a batch x length x vocab logits
    tensor) is never needed here."""
    return model.base_model(input_ids=input_ids, output_hidden_states=True)


def feature_compute_dtype(model: torch.nn.Module, precision: str = DEVICE_PRECISION) -> str:
    """`bf16` or `fp32`: what the frozen target computes features in under `precision` (a FEATURE_PRECISIONS)."""
    device = model_device(model)
    if precision == DEVICE_PRECISION:
        return "bf16" if is_accelerator(device) else "fp32"
    return computes_in(device, precision)


def target_precision(model: torch.nn.Module, precision: str = DEVICE_PRECISION):
    """How the frozen target computes features, for the cache and online alike (the stored dtypes stay those of
    `stored` either way)."""
    return autocast(model_device(model), feature_compute_dtype(model, precision))


# How far features computed in bf16 (an accelerator's cache) may lie from fp32 ones (a CPU's), both as the cache
# stores them: the relative difference of each selected layer over a document's tokens. Storing in bf16 alone
# rounds at 2^-9; benchmarks/training/FEATURE_PRECISION.md records what computing in bf16 adds on each machine, a
# few times below this bound.
BF16_FEATURE_TOLERANCE = 0.02


def relative_difference(features: torch.Tensor, reference: torch.Tensor, num_layers: int) -> list[float]:
    """Per selected layer, ||features - reference|| / ||reference|| of [L, n_T*H] features (RMS over tokens)."""
    found = features.float().unflatten(-1, (num_layers, -1))
    expected = reference.float().unflatten(-1, (num_layers, -1))
    return [
        (torch.linalg.vector_norm(found[:, i] - expected[:, i]) / torch.linalg.vector_norm(expected[:, i])).item()
        for i in range(num_layers)
    ]


def stored(features: torch.Tensor, final: torch.Tensor, final_as: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A document's features as the cache keeps them (and online mode hands them over)."""
    return features.to(FEATURE_DTYPE), final.to(final_as)


def fill(row: PackedRow, members: list[int], source: FeatureSource, offset: int) -> PackedRow:
    """`row` with the features of its documents [offset + i for i in members], padded to its length."""
    features, finals = zip(*(source.document(offset + i) for i in members), strict=True)
    pad = row.length - sum(f.shape[0] for f in features)
    row.features = torch.cat([*features, features[0].new_zeros(pad, features[0].shape[1])])
    row.target_hidden = torch.cat([*finals, finals[0].new_zeros(pad, finals[0].shape[1])])
    return row


def packed_rows(
    source: FeatureSource, offset: int, documents: list[Document], row_length: int, with_features: bool = True
) -> tuple[list[PackedRow], list[list[int]]]:
    """Documents [offset, offset + len) packed into rows, and each row's document indices; with their features
    filled in, or left for `fill` at training time (online mode)."""
    rows, members = pack_documents(documents, row_length)
    if with_features:
        rows = [fill(row, indices, source, offset) for row, indices in zip(rows, members, strict=True)]
    return rows, members


def document_rows(source: FeatureSource, offset: int, documents: list[Document]) -> list[PackedRow]:
    """One unpadded row per document [offset, offset + len): the unit validation statistics cluster on."""
    return [fill(pack_row([doc], len(doc.input_ids)), [i], source, offset) for i, doc in enumerate(documents)]


def estimated_bytes(tokens: int, hidden_size: int, num_layers: int, target_dtype: str) -> int:
    """Disk a cache of `tokens` needs: the selected layers in bf16 plus the final hidden state."""
    return tokens * hidden_size * (num_layers * FEATURE_DTYPE.itemsize + final_dtype(target_dtype).itemsize)


def cache_key(
    target_hash: str,
    dataset_hash: str,
    layer_ids: list[int],
    max_length: int,
    final: torch.dtype,
    computed_in: str = "fp32",
) -> str:
    """What the cache's content depends on (never the number of ranks that extracted it)."""
    identity = {
        "target": target_hash,
        "dataset": dataset_hash,
        "layers": list(layer_ids),
        "max_length": max_length,
        "final_dtype": dtype_name(final),
    }
    if computed_in != "fp32":  # so a cache computed in fp32 keeps the key it had before this was part of it
        identity["computed_in"] = computed_in
    return stable_hash(identity)


def verify(directory: Path, manifest: dict) -> None:
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.exists() or path.stat().st_size != shard["bytes"] or file_sha256(path) != shard["sha256"]:
            raise CorruptFeatureCache(f"feature shard {path} is missing, truncated or corrupt (checksum mismatch)")


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """The draft's context features: the selected target hidden states side by side, [..., T, n*H]."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def extract(
    target,
    documents: list[Document],
    layer_ids: list[int],
    directory: Path,
    batch_size: int = 8,
    ranks: Ranks = SINGLE,
    precision: str = DEVICE_PRECISION,
) -> dict:
    """One pass of the target per document (no cross-document attention), written shard by shard; under
    torchrun each rank writes every world_size-th shard, and rank 0 the manifest once all are written. The shards
    do not depend on who wrote them, so the checksums equal a one-process extraction's."""
    manifest: dict = {}
    write = lambda tmp: manifest.update(  # noqa: E731
        _extract_into(tmp, target, documents, layer_ids, batch_size, ranks, precision)
    )
    if ranks.is_main:
        atomic_write(directory, write)
    else:
        write(None)
    ranks.barrier()  # the cache is in place before any rank reads it
    return ranks.from_main(manifest)


def _extract_into(
    tmp: Path | None,
    target,
    documents: list[Document],
    layer_ids: list[int],
    batch_size: int,
    ranks: Ranks,
    precision: str,
) -> dict:
    if ranks.is_main:  # atomic_write cleared any leftover at `tmp`
        tmp.mkdir(parents=True)
    tmp = ranks.from_main(tmp)
    final_as = final_dtype(target.dtype)
    starts = range(0, len(documents), DOCS_PER_SHARD)
    mine = [starts[i] for i in ranks.indices(len(starts))]
    tokens = sum(len(d.input_ids) for start in mine for d in documents[start : start + DOCS_PER_SHARD])
    shards = {}
    with tqdm(total=tokens, desc="extracting target features", unit="tok", disable=not ranks.is_main) as bar:
        for shard_start in mine:
            shard = documents[shard_start : shard_start + DOCS_PER_SHARD]
            tensors = {}
            for start in range(0, len(shard), batch_size):
                batch = shard[start : start + batch_size]
                for offset, kept in enumerate(batch_features(target, batch, layer_ids, final_as, precision)):
                    index = shard_start + start + offset
                    features, final = (t.cpu().contiguous() for t in kept)  # the shard is written from the host
                    tensors[f"doc{index}.features"], tensors[f"doc{index}.final"] = features, final
                bar.update(sum(len(d.input_ids) for d in batch))
            number = shard_start // DOCS_PER_SHARD
            name = f"shard-{number:05d}.safetensors"
            save_file(tensors, tmp / name)
            shards[number] = {"file": name, "bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
    for part in ranks.gather(shards):
        shards.update(part)
    manifest = {
        "layer_ids": list(layer_ids),
        "num_documents": len(documents),
        "tokens": sum(len(d.input_ids) for d in documents),
        "final_dtype": dtype_name(final_as),
        "computed_in": feature_compute_dtype(target.model, precision),
        "shards": [shards[number] for number in range(len(starts))],
        "documents": [index // DOCS_PER_SHARD for index in range(len(documents))],
    }
    if ranks.is_main:
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def batch_features(
    target, batch: list[Document], layer_ids: list[int], final_as: torch.dtype, precision: str = DEVICE_PRECISION
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each document's (features, final) as the cache stores them, on the target's device, from one padded
    forward of the batch (computed as `target_precision` says).

    The batch is padded on the right and the target is causal, so no kept token ever attends to padding: no
    attention mask is passed (Transformers would read a padding mask back from the device to inspect it)."""
    device = model_device(target.model)
    width = max(len(d.input_ids) for d in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for row, doc in enumerate(batch):
        ids[row, : len(doc.input_ids)] = torch.tensor(doc.input_ids)
    with target_precision(target.model, precision):
        out = hidden_states_of(target.model, ids.to(device))
    hidden = out.hidden_states  # [0] embeddings ... [n] post-final-norm
    features = target_features(hidden, layer_ids)
    sizes = [len(doc.input_ids) for doc in batch]
    return [stored(features[row, :size], hidden[-1][row, :size], final_as) for row, size in enumerate(sizes)]


def load_or_build(
    target,
    documents: list[Document],
    dataset_hash: str,
    layer_ids: list[int],
    max_length: int,
    cache_dir: Path,
    on_corrupt: str = "rebuild",
    ranks: Ranks = SINGLE,
    precision: str = DEVICE_PRECISION,
) -> tuple[FeatureCache, bool]:
    """The cache for (target, data, layers, max length, compute dtype); builds it on a miss (under torchrun, every
    rank a share of it). Returns (cache, was_hit).

    A corrupt or partial cache is never used: it is rebuilt (`on_corrupt="rebuild"`) or raises.
    """
    computed_in = feature_compute_dtype(target.model, precision)
    key = cache_key(target.weights_hash, dataset_hash, layer_ids, max_length, final_dtype(target.dtype), computed_in)
    directory = cache_dir / "features" / key
    found = ranks.from_main(_verified(directory, on_corrupt) if ranks.is_main else None)
    if isinstance(found, str):
        raise CorruptFeatureCache(found)
    if found is not None:
        return FeatureCache(directory, found), True
    log.info("feature cache miss: extracting %d documents into %s", len(documents), directory)
    manifest = extract(target, documents, layer_ids, directory, ranks=ranks, precision=precision)
    return FeatureCache(directory, manifest), False


def _verified(directory: Path, on_corrupt: str) -> dict | str | None:
    """The cache's manifest when the cache is whole; None when missing (or corrupt, to rebuild); the error
    when corrupt and not to be rebuilt."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    try:
        verify(directory, manifest)
    except CorruptFeatureCache as error:
        if on_corrupt != "rebuild":
            return f"{error}; delete {directory} or run `dflash-lab prepare` to rebuild it"
        log.warning("%s; rebuilding the feature cache", error)
        return None
    log.info(
        "feature cache hit: %s (%d documents, %d tokens)", directory, manifest["num_documents"], manifest["tokens"]
    )
    return manifest
