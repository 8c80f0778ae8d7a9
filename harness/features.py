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
from harness.devices import ids_on, model_device
from harness.files import atomic_write
from harness.targets import file_sha256

log = logging.getLogger(__name__)
DOCS_PER_SHARD = 64
FEATURE_DTYPE, FINAL_DTYPE = torch.bfloat16, torch.float32  # per token: the selected layers, the final state


class CorruptFeatureCache(RuntimeError):
    """A shard's size or checksum disagrees with the manifest written after it."""


@dataclass
class FeatureCache:
    """Per-document target features ([L, n_T*H] bf16) and final hidden states ([L, H] fp32) on disk."""

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

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.target.model
        with torch.no_grad():
            out = model(
                input_ids=ids_on(self.documents[index].input_ids, model_device(model)), output_hidden_states=True
            )
        return stored(target_features(out.hidden_states, self.layer_ids)[0], out.hidden_states[-1][0])


def stored(features: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A document's features as the cache keeps them (and online mode hands them over): bf16 and fp32."""
    return features.to(FEATURE_DTYPE), final.to(FINAL_DTYPE)


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


def estimated_bytes(tokens: int, hidden_size: int, num_layers: int) -> int:
    """Disk a cache of `tokens` needs: the selected layers in bf16 plus the final hidden state in fp32."""
    return tokens * hidden_size * (num_layers * FEATURE_DTYPE.itemsize + FINAL_DTYPE.itemsize)


def cache_key(target_hash: str, dataset_hash: str, layer_ids: list[int], max_length: int) -> str:
    return stable_hash(
        {"target": target_hash, "dataset": dataset_hash, "layers": list(layer_ids), "max_length": max_length}
    )


def verify(directory: Path, manifest: dict) -> None:
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.exists() or path.stat().st_size != shard["bytes"] or file_sha256(path) != shard["sha256"]:
            raise CorruptFeatureCache(f"feature shard {path} is missing, truncated or corrupt (checksum mismatch)")


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """The draft's context features: the selected target hidden states side by side, [..., T, n*H]."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def extract(target, documents: list[Document], layer_ids: list[int], directory: Path, batch_size: int = 8) -> dict:
    """One pass of the target per document (no cross-document attention), written shard by shard."""
    manifest: dict = {}
    atomic_write(directory, lambda tmp: manifest.update(_extract_into(tmp, target, documents, layer_ids, batch_size)))
    return manifest


def _extract_into(tmp: Path, target, documents: list[Document], layer_ids: list[int], batch_size: int) -> dict:
    tmp.mkdir(parents=True)
    device = next(target.model.parameters()).device
    shards, doc_to_shard = [], []
    tokens = sum(len(d.input_ids) for d in documents)
    with tqdm(total=tokens, desc="extracting target features", unit="tok") as bar:
        for shard_start in range(0, len(documents), DOCS_PER_SHARD):
            tensors = {}
            for start in range(shard_start, min(shard_start + DOCS_PER_SHARD, len(documents)), batch_size):
                batch = documents[start : min(start + batch_size, shard_start + DOCS_PER_SHARD, len(documents))]
                width = max(len(d.input_ids) for d in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                attention = torch.zeros(len(batch), width, dtype=torch.long)
                for row, doc in enumerate(batch):
                    ids[row, : len(doc.input_ids)] = torch.tensor(doc.input_ids)
                    attention[row, : len(doc.input_ids)] = 1
                out = target.model(
                    input_ids=ids.to(device), attention_mask=attention.to(device), output_hidden_states=True
                )
                hidden = out.hidden_states  # [0] embeddings ... [n] post-final-norm
                features = target_features(hidden, layer_ids)
                for row, doc in enumerate(batch):
                    size = len(doc.input_ids)
                    index = start + row
                    kept = stored(features[row, :size], hidden[-1][row, :size])
                    tensors[f"doc{index}.features"], tensors[f"doc{index}.final"] = (t.cpu().contiguous() for t in kept)
                    bar.update(size)
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(tensors, tmp / name)
            shards.append({"file": name, "bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)})
            doc_to_shard += [len(shards) - 1] * (len(tensors) // 2)
    manifest = {
        "layer_ids": list(layer_ids),
        "num_documents": len(documents),
        "tokens": tokens,
        "shards": shards,
        "documents": doc_to_shard,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def load_or_build(
    target,
    documents: list[Document],
    dataset_hash: str,
    layer_ids: list[int],
    max_length: int,
    cache_dir: Path,
    on_corrupt: str = "rebuild",
) -> tuple[FeatureCache, bool]:
    """The cache for (target, data, layers, max length); builds it on a miss. Returns (cache, was_hit).

    A corrupt or partial cache is never used: it is rebuilt (`on_corrupt="rebuild"`) or raises.
    """
    directory = cache_dir / "features" / cache_key(target.weights_hash, dataset_hash, layer_ids, max_length)
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        try:
            verify(directory, manifest)
            log.info(
                "feature cache hit: %s (%d documents, %d tokens)",
                directory,
                manifest["num_documents"],
                manifest["tokens"],
            )
            return FeatureCache(directory, manifest), True
        except CorruptFeatureCache as error:
            if on_corrupt != "rebuild":
                raise CorruptFeatureCache(
                    f"{error}; delete {directory} or run `dflash-lab prepare` to rebuild it"
                ) from None
            log.warning("%s; rebuilding the feature cache", error)
    log.info("feature cache miss: extracting %d documents into %s", len(documents), directory)
    return FeatureCache(directory, extract(target, documents, layer_ids, directory)), False
