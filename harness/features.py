"""Target features, extracted once and shared: keyed, atomic, checksummed safetensors shards."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from algorithms.blocks import PackedRow
from harness.data import Document, pack_documents, pack_row, stable_hash
from harness.files import atomic_write
from harness.targets import file_sha256

log = logging.getLogger(__name__)
DOCS_PER_SHARD = 64


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

    def document_rows(self, offset: int, documents: list[Document]) -> list[PackedRow]:
        """One unpadded row per document [offset, offset + len): the unit validation statistics cluster on."""
        rows = []
        for index, doc in enumerate(documents):
            row = pack_row([doc], len(doc.input_ids))
            row.features, row.target_hidden = self.document(offset + index)
            rows.append(row)
        return rows

    def packed_rows(self, offset: int, documents: list[Document], row_length: int) -> list[PackedRow]:
        """Pack documents [offset, offset + len) into rows, with their cached features filled in."""
        rows, members = pack_documents(documents, row_length)
        for row, indices in zip(rows, members, strict=True):
            features, finals = zip(*(self.document(offset + i) for i in indices), strict=True)
            used = sum(f.shape[0] for f in features)
            pad = row_length - used
            row.features = torch.cat([*features, features[0].new_zeros(pad, features[0].shape[1])])
            row.target_hidden = torch.cat([*finals, finals[0].new_zeros(pad, finals[0].shape[1])])
        return rows


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
                    tensors[f"doc{index}.features"] = features[row, :size].to(torch.bfloat16).cpu().contiguous()
                    tensors[f"doc{index}.final"] = hidden[-1][row, :size].float().cpu().contiguous()
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
