"""`draft_init: target`: a draft whose layers start as the target's own, checked tensor by tensor and by what the
first draft layer computes from the target's hidden states."""

import pytest
import torch

from algorithms import ALGORITHMS, TargetLayers, build_draft
from harness.features import hidden_states_of, target_features
from harness.targets import load_target

from conftest import frozen_tensors, tiny_config, tiny_llama, tiny_target

TINY_LAYERS = 8  # tiny_target()'s; its default fed hidden states are [2, 4, 5]


def tiny_target_layers(seed: int = 0) -> TargetLayers:
    torch.manual_seed(seed)
    llama = tiny_llama()
    return TargetLayers([layer.state_dict() for layer in llama.model.layers], llama.model.norm.weight)


def built(algorithm: str, layers: TargetLayers, **overrides):
    embed, head = frozen_tensors()
    config = tiny_config(algorithm, **{"draft_init": "target", **overrides})
    return build_draft(config, tiny_target(), embed, head, layers)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("depth", "first"), [(2, 5), (4, 4)], ids=["after-the-last-fed", "moved-down-to-fit"])
def test_each_draft_layer_is_a_copy_of_its_target_layer(algorithm, depth, first):
    layers = tiny_target_layers()
    draft = built(algorithm, layers, num_draft_layers=depth)
    for j, layer in enumerate(draft.layers):
        source, own = layers.layers[first + j], layer.state_dict()
        copied = [name for name in source if name in own]
        assert set(copied) >= set(draft.COPIED_FROM_TARGET) | {"input_layernorm.weight"}
        for name in copied:
            assert torch.equal(own[name], source[name]), (j, name)
    assert torch.equal(draft.hidden_norm.weight, layers.layers[first]["input_layernorm.weight"])
    assert torch.equal(draft.norm.weight, layers.final_norm)
    features = torch.randn(7, 3 * tiny_target().hidden_size)
    assert torch.equal(draft.fc(features), features[:, -tiny_target().hidden_size :])  # the last fed state, as is


def test_a_random_draft_copies_nothing_and_a_target_draft_keeps_its_own_conv_init():
    layers = tiny_target_layers()
    torch.manual_seed(0)
    random = built("dflash2", layers, draft_init="random")
    torch.manual_seed(0)
    copied = built("dflash2", layers)
    source = layers.layers[5]["self_attn.q_proj.weight"]
    assert not torch.equal(random.layers[0].self_attn.q_proj.weight, source)
    for mine, theirs in zip(random.layers, copied.layers, strict=True):  # the convs start as the identity either way
        for name, tensor in mine.attention_conv.state_dict().items():
            assert torch.equal(tensor, theirs.attention_conv.state_dict()[name]), name


def test_the_first_draft_layer_computes_the_values_the_target_layer_computes(tmp_path):
    """Draft layer 0 reads its context's keys and values through the copied projections from hidden_norm(fc(features))
    = the input norm of the last fed hidden state: for a real (tiny) target, its values equal the ones target layer
    `first` computes on the same text."""
    from test_targets import saved_target

    target = load_target(saved_target(tmp_path / "target"), tmp_path)
    config = tiny_config("dflash", draft_init="target")
    draft = build_draft(config, target.spec, target.embed_weight, target.head_weight, target.layers)
    ids = draft.config.target_layer_ids
    ids_in = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        hidden = hidden_states_of(target.model, ids_in).hidden_states
        context = draft.hidden_norm(draft.fc(target_features(hidden, ids)[0]))
        ours = draft.layers[0].self_attn.v_proj(context)
        layer = target.model.model.layers[ids[-1]]
        theirs = layer.self_attn.v_proj(layer.input_layernorm(hidden[ids[-1]]))[0]
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_a_draft_deeper_than_its_target_or_without_its_layers_is_refused_in_one_line():
    embed, head = frozen_tensors()
    with pytest.raises(ValueError) as deeper:
        built("dflash", tiny_target_layers(), num_draft_layers=TINY_LAYERS + 1)
    assert str(deeper.value) == (
        "invalid knob draft_init='target': allowed random for a draft deeper than its target's 8 layers"
    )
    with pytest.raises(ValueError, match="allowed random where the target's layers are not loaded"):
        build_draft(tiny_config("dflash", draft_init="target"), tiny_target(), embed, head)
    layers = tiny_target_layers()
    no_mlp = TargetLayers(
        [{k: v for k, v in layer.items() if not k.startswith("mlp.")} for layer in layers.layers], layers.final_norm
    )
    with pytest.raises(ValueError, match=r"allowed random for a target whose layers lack \['mlp.gate_proj.weight'"):
        built("dflash", no_mlp)
    with pytest.raises(ValueError, match=r"draft_init='verifier': allowed one of \['random', 'target'\]"):
        tiny_config("dflash", draft_init="verifier").validate()
