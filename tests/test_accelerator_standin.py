"""The accelerator paths, run on an accelerator stand-in: PyTorch's `meta` device.

A `meta` tensor has a shape, a dtype and a device but no data. Mixing it with a host tensor raises ("... is not
on the expected device meta!"), and so does every read of a value (`.item()`, `.tolist()`, `bool()`, `.cpu()`,
`torch.nonzero`, `torch.unique`). So a training step that runs with the draft, its frozen tensors and its batch
on `meta` proves that no tensor of the step stayed on the host and that the step never reads a value back,
which on CUDA would be a hidden sync. `meta` rather than `FakeTensorMode`: the code moves tensors with
`.to(device)`, and under fake tensors `.to("cuda")` fails on a CPU-only build of torch.

The code takes its accelerator branches here (`harness.devices.is_accelerator` is true for `meta`), e.g. the
unary head's fixed-shape chunks. What cannot run on the stand-in, kept to the smallest seam:
- autocast: `meta` has none, so `harness.devices.autocast` is a null context there (bf16 autocast runs on
  the CPU in tests/test_knobs.py and on CUDA in scripts/gpu_check.sh);
- device generators: the host draws rows and anchors anyway (tests/test_devices.py checks the helper);
- the decoding loop's data-dependent control flow, which reads acceptance by design: scripts/gpu_check.sh
  audits it on the GPU with `torch.cuda.set_sync_debug_mode` and counts its syncs per cycle;
- the host reads that happen by design at log, validation and save time (`LossWatch.check`, validation's
  finalisation, writing a feature shard), which every CPU test runs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import algorithms.unary_head as unary_head
from harness import devices, train
from harness.config import RunConfig
from harness.data import Document
from harness.features import OnlineFeatures, batch_features, final_dtype, packed_rows
from harness.train import LossWatch, TrainingRecipe, Workspace
from harness.validation import subset_counts

from conftest import HIDDEN, TARGET_LAYERS, VOCAB, tiny_config, tiny_llama, tiny_target

STANDIN = "meta"
STEPS = 3  # the optimizer's state exists from the first step; later steps use it


def standin_target(device: str = STANDIN) -> SimpleNamespace:
    """A tiny Llama verifier, frozen, on the stand-in in the dtype an accelerator loads it in (bf16), as
    `harness.targets.Target` gives the recipe."""
    spec = tiny_target()
    torch.manual_seed(0)
    model = tiny_llama().eval().requires_grad_(False).to(device, devices.target_weights_dtype(device))
    return SimpleNamespace(
        model=model,
        spec=spec,
        embed_weight=model.get_input_embeddings().weight,
        head_weight=model.get_output_embeddings().weight,
        mask_token_id=5,
        dtype="float32",
    )


def documents(count: int = 6) -> list[Document]:
    """Conversations of different lengths, the first 3 tokens of each a prompt."""
    generator = torch.Generator().manual_seed(0)
    sizes = [18 + 5 * i for i in range(count)]
    return [
        Document(torch.randint(6, VOCAB, (n,), generator=generator).tolist(), [0] * 3 + [1] * (n - 3)) for n in sizes
    ]


def run_config(algorithm: str) -> RunConfig:
    """The unit tests' tiny config, its target layers pinned as a recipe pins them."""
    algorithm_config = tiny_config(algorithm)
    layers = algorithm_config.shared.resolve_target_layer_ids(TARGET_LAYERS)
    config = RunConfig(algorithm_config.replace(target_layer_ids=layers))
    config.train.max_steps, config.train.precision = STEPS, "auto"
    return config


def standin_recipe(algorithm: str, features: str, tmp_path) -> TrainingRecipe:
    """The training recipe on the stand-in, on rows whose features come from a host cache (as they are read
    from disk) or from the target itself inside the step (`online`)."""
    config = run_config(algorithm)
    target, docs = standin_target(), documents()
    layer_ids = config.algorithm.shared.target_layer_ids
    source = OnlineFeatures(target, docs, layer_ids)
    validation_docs, train_docs = docs[:2], docs[2:]
    if features == "cache":  # a cache hands the step host tensors: the features of the same shapes, on the host
        source = SimpleNamespace(document=lambda i: host_features(docs[i], len(layer_ids)))
    train_rows, members = packed_rows(source, 2, train_docs, 64, with_features=features == "cache")
    validation_rows, _ = packed_rows(source, 0, validation_docs, 64)
    data = SimpleNamespace(
        validation=validation_docs, train=train_docs, dataset_id="standin", dataset_hash="h", decontaminated=0
    )
    workspace = Workspace(tmp_path, target, data, source, False, train_rows, validation_rows, [], members)
    return TrainingRecipe(config, workspace, run=None, device=STANDIN)


def host_features(document: Document, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = len(document.input_ids)
    return torch.randn(length, num_layers * HIDDEN).bfloat16(), torch.randn(length, HIDDEN)


def on_standin(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == STANDIN for t in tensors)


@pytest.mark.parametrize("features", ["cache", "online"])
@pytest.mark.parametrize("algorithm", ["dflash", "dflash2", "jetspec", "domino", "dspark"])
def test_training_steps_run_on_the_accelerator_stand_in(algorithm, features, tmp_path):
    """Several optimizer steps (forward, the fixed-shape unary head, backward, clipping, AdamW, the schedule and
    the loss watch): every tensor on the device, and not one value read back."""
    recipe = standin_recipe(algorithm, features, tmp_path)
    assert devices.uses_bf16(STANDIN, "auto"), "the stand-in takes the accelerator's precision branch"
    for step in range(STEPS):
        output = recipe.step(step)
    assert on_standin(output.loss, recipe.grad_norm, *output.counts.values(), *recipe.draft.parameters())
    moments = [t for state in recipe.optimizer.state.values() for t in state.values() if t.dim()]
    assert moments and on_standin(*moments)
    assert on_standin(recipe.watch.first_bad_step, recipe.watch.loss, recipe.watch.any_nonzero)
    assert recipe.schedule.last_epoch == STEPS


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_validation_and_feature_extraction_forwards_run_on_the_stand_in(algorithm, tmp_path):
    recipe = standin_recipe(algorithm, "cache", tmp_path)
    counts, row_pairs = subset_counts(recipe.draft, recipe.workspace.validation_rows, STANDIN, "auto")
    assert counts and on_standin(*counts.values(), *row_pairs)
    target, docs = recipe.workspace.target, documents()
    layer_ids = recipe.config.algorithm.shared.target_layer_ids
    extracted = batch_features(target, docs[:3], layer_ids, final_dtype(target.dtype))
    for (features, final), doc in zip(extracted, docs, strict=False):
        assert on_standin(features, final)
        assert features.shape == (len(doc.input_ids), len(layer_ids) * HIDDEN) and final.shape[1] == HIDDEN


def test_online_features_compute_in_the_feature_precision_asked_for():
    """`train.feature_precision` reaches online mode too: bf16 on a CPU computes other features than its default."""
    target, docs = standin_target("cpu"), documents(1)
    fp32, bf16 = (OnlineFeatures(target, docs, [1, 2], precision).document(0)[0] for precision in ("device", "bf16"))
    assert fp32.shape == bf16.shape and not torch.equal(fp32, bf16)


@torch.no_grad()
def test_a_padded_extraction_batch_gives_each_document_its_own_forward():
    """Right padding under causal attention needs no mask: each document's features equal its forward alone."""
    from harness.features import target_features

    target, docs = standin_target("cpu"), documents(3)
    layer_ids = [2, 4, 7]
    extracted = batch_features(target, docs, layer_ids, torch.float32)
    for (features, final), doc in zip(extracted, docs, strict=True):
        hidden = target.model(input_ids=torch.tensor([doc.input_ids]), output_hidden_states=True).hidden_states
        alone = target_features(hidden, layer_ids)[0]
        assert torch.allclose(features.float(), alone.bfloat16().float(), atol=1e-2)
        assert torch.allclose(final, hidden[-1][0], atol=1e-5)


# ---- the test fails on what it exists to catch: deliberately broken copies of a step's parts ----------------


def leaves_target_hidden_on_the_host(row, anchors, device):
    """`harness.devices.to_device` with one tensor of the row forgotten on the host."""
    moved_row, moved_anchors = devices.to_device(row, anchors, device)
    moved_row.target_hidden = row.target_hidden
    return moved_row, moved_anchors


class LossWatchThatReadsTheLoss(LossWatch):
    """A loss watch with the obvious host read (`float(loss)` each step): a sync per step on CUDA."""

    def record(self, step: int, loss: torch.Tensor) -> None:
        if not math.isfinite(float(loss)):
            raise RuntimeError("non-finite loss")
        super().record(step, loss)


def test_a_tensor_left_on_the_host_fails_the_stand_in_step(tmp_path, monkeypatch):
    recipe = standin_recipe("dflash2", "cache", tmp_path)
    monkeypatch.setattr(train, "to_device", leaves_target_hidden_on_the_host)
    with pytest.raises(RuntimeError, match="is not on the expected device|on device cpu"):
        recipe.step(0)


def test_a_host_read_in_the_step_fails_the_stand_in_step(tmp_path):
    recipe = standin_recipe("dflash2", "cache", tmp_path)
    recipe.watch = LossWatchThatReadsTheLoss(STANDIN)
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        recipe.step(0)


def test_the_host_only_compacting_head_fails_the_stand_in_step(tmp_path, monkeypatch):
    """The unary head's CPU path compacts each chunk to its supervised rows, which needs their count on the
    host: taken on an accelerator, it would stall the queue once per chunk."""
    recipe = standin_recipe("dflash", "cache", tmp_path)
    monkeypatch.setattr(unary_head, "COMPACTING_DEVICE_TYPES", ("cpu", STANDIN))
    with pytest.raises(NotImplementedError, match="nonzero"):
        recipe.step(0)
