"""Exported checkpoints: exact native layout, consistent dual config, and they load in Z Lab's dflash 0.1.0."""

import json

import pytest
import torch
from safetensors.torch import load_file

from algorithms import ALGORITHMS, build_draft
from harness.export import export_checkpoint, load_exported_weights

from conftest import LLAMA3_ROPE, frozen_tensors, tiny_config, tiny_draft, tiny_target

dflash_model = pytest.importorskip(
    "dflash.model", reason="dflash==0.1.0 (Z Lab reference) is not installed; .ci/run installs it with --no-deps"
)


def _perturbed(algorithm):
    has_selector = ALGORITHMS[algorithm].has_selector
    draft = tiny_draft(algorithm, selector_init="normal") if has_selector else tiny_draft(algorithm)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "conv" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return draft


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_export_layout_and_dual_config(tmp_path, algorithm):
    draft = _perturbed(algorithm)
    out = export_checkpoint(draft, tmp_path / "ckpt", "/models/verifier")
    tensors = load_file(out / "model.safetensors")
    layers = draft.config.num_layers
    assert len(tensors) == (15 * layers + 6 if algorithm == "dflash2" else 11 * layers + 3)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) or k in ("t2d", "d2t") for k in tensors)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel" if algorithm == "dflash2" else "DFlashDraftModel"]
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"] == 5
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["vocab_size"] == config["draft_vocab_size"] == 300
    assert config["is_causal"] is False and config["sliding_window_non_causal"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "layer_types",
        "is_causal",
    ):
        assert config[key] == config["transformer_layer_config"][key]
    if algorithm == "dflash2":
        assert (
            "candidate_selector.predecessor_codebook" in tensors
            and "candidate_selector.successor_codebook.weight" not in tensors
        )
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            assert config[key] == config["dflash_config"][key]


@pytest.mark.peer
@pytest.mark.parametrize("algorithm", ["dflash", "dflash2", "dflash+selector", "dflash+conv"])
def test_export_loads_in_zlab_dflash_with_matching_outputs(tmp_path, algorithm):
    """The two component variants are written as DFlash2: dflash+selector with the identity conv, which Z Lab's
    DFlash2 model computes exactly as the conv-free layers here; dflash+conv with the null selector, whose walk is
    the unary argmax path this draft decodes."""
    draft = _perturbed(algorithm)
    out = export_checkpoint(draft, tmp_path / "ckpt", "/models/verifier")
    load_exported_weights(draft, out)  # ours with the same bf16-rounded weights
    selector = algorithm != "dflash"  # every other one is read as DFlash2
    cls = dflash_model.DFlash2DraftModel if selector else dflash_model.DFlashDraftModel
    theirs = cls.from_pretrained(out, dtype=torch.float32).eval()
    assert theirs.target_layer_ids == [i - 1 for i in draft.config.target_layer_ids]
    assert theirs.block_size == draft.block_size and theirs.mask_token_id == draft.config.mask_token_id
    generator = torch.Generator().manual_seed(0)
    context_length, anchor = 11, 42
    features = torch.randn(context_length, 3 * 64, generator=generator)
    ours = draft.single_block_hidden(features, torch.arange(context_length), anchor, context_length, draft.block_size)
    block_ids = torch.full((draft.block_size,), draft.config.mask_token_id)
    block_ids[0] = anchor
    with torch.no_grad():
        reference = theirs(
            position_ids=torch.arange(context_length + draft.block_size)[None],
            noise_embedding=draft.embed_weight[block_ids][None],
            target_hidden=features[None],
        )[0]
    assert torch.allclose(ours, reference, atol=1e-4)
    head = torch.nn.Linear(64, 300, bias=False)
    head.weight.data = draft.head_weight
    assert torch.allclose(draft.output_logits(ours), theirs.compute_logits(reference, head), atol=1e-4)
    if selector:
        path, _, _ = theirs.propose(reference[None, 1:], torch.tensor([anchor]), head, 0.0)
        assert torch.equal(
            path[0], draft.propose_from_hidden(ours[1:], draft.output_logits(ours)[1:], anchor, 0.0, None).tokens
        )


@pytest.mark.peer
def test_a_rope_scaled_export_rotates_in_zlab_dflash_as_here(tmp_path):
    """A Llama-3.x target's scaled RoPE reaches the export: Z Lab's model, built from its config alone, gives the
    draft's hidden states, and these differ from the unscaled draft's."""
    embed, head = frozen_tensors()
    torch.manual_seed(0)
    draft = build_draft(tiny_config("dflash"), tiny_target(rope_scaling=LLAMA3_ROPE), embed, head)
    out = export_checkpoint(draft, tmp_path / "ckpt", "/models/verifier")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 10000.0} and config["rope_scaling"] == LLAMA3_ROPE
    load_exported_weights(draft, out)
    theirs = dflash_model.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    features = torch.randn(40, 3 * 64, generator=torch.Generator().manual_seed(0))
    ours = draft.single_block_hidden(features, torch.arange(40), 42, 40, draft.block_size)
    block_ids = torch.full((draft.block_size,), draft.config.mask_token_id)
    block_ids[0] = 42
    with torch.no_grad():
        reference = theirs(
            position_ids=torch.arange(40 + draft.block_size)[None],
            noise_embedding=draft.embed_weight[block_ids][None],
            target_hidden=features[None],
        )[0]
    assert torch.allclose(ours, reference, atol=1e-4)
    draft.config.target.rope_scaling = None
    unscaled = draft.single_block_hidden(features, torch.arange(40), 42, 40, draft.block_size)
    assert not torch.allclose(unscaled, reference, atol=1e-3)
