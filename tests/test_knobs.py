import pytest
import torch

from algorithms import AlgorithmConfig, build_draft
from algorithms.knobs import DFlash2Knobs, SharedKnobs

from conftest import frozen_tensors, tiny_config, tiny_target


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_config_round_trips_through_dict(algorithm):
    config = tiny_config(
        algorithm, loss={"ce": 0.1, "tv": 0.9}, position_weighting="fixed-exp-decay", target_layer_ids=[1, 4, 6]
    )
    assert AlgorithmConfig.from_dict(config.to_dict()) == config
    params = config.flat_params()
    assert params["algorithm"] == algorithm
    assert params["shared.block_size"] == 4
    assert params["shared.target_layer_ids"] == "[1, 4, 6]"


def test_presets_are_the_published_defaults():
    dflash, dflash2 = AlgorithmConfig.preset("dflash"), AlgorithmConfig.preset("dflash2")
    assert (dflash.shared.block_size, dflash.shared.loss, dflash.shared.position_weighting) == (16, "ce", "dpace")
    assert (dflash2.shared.block_size, dflash2.shared.loss, dflash2.shared.position_weighting) == (
        8,
        "kl_div",
        "fixed-exp-decay",
    )
    assert dflash2.knobs == DFlash2Knobs(
        conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_loss_alpha=1.0
    )
    for config in (dflash, dflash2):
        assert config.shared.block_attention == "bidirectional"
        assert config.shared.num_draft_layers == 5 and config.shared.max_anchors == 512


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match="invalid knob knob='selector_rank'"):
        AlgorithmConfig.preset("dflash", selector_rank=4)


def _build(algorithm, **overrides):
    embed, head = frozen_tensors()
    return build_draft(tiny_config(algorithm, **overrides), tiny_target(), embed, head)


def test_pruned_vocab_rejected_for_dflash2():
    with pytest.raises(
        ValueError,
        match=r"draft_vocab_size=100: allowed the full verifier vocabulary 300: a selector picks candidates",
    ):
        _build("dflash2", draft_vocab_size=100)


def test_top_k_above_vocab_rejected():
    with pytest.raises(ValueError, match=r"candidate_top_k=301.*\[1, vocab_size=300\]"):
        _build("dflash2", candidate_top_k=301)


def test_top_k_below_one_rejected():
    with pytest.raises(ValueError, match=r"candidate_top_k=0.*>= 1"):
        _build("dflash2", candidate_top_k=0)


def test_conv_kernel_above_block_rejected():
    with pytest.raises(ValueError, match=r"conv_kernel_size=5.*\[1, block_size=4\]"):
        _build("dflash2", conv_kernel_size=5)


def test_conv_kernel_below_one_rejected():
    with pytest.raises(ValueError, match=r"conv_kernel_size=0.*\[1, block_size=4\]"):
        _build("dflash2", conv_kernel_size=0)


def test_group_size_must_divide_hidden():
    with pytest.raises(ValueError, match=r"conv_group_size=7.*divisor of the hidden size 64"):
        _build("dflash2", conv_group_size=7)


def test_dflash2_rejects_sample_from_anchor():
    with pytest.raises(ValueError, match=r"sample_from_anchor=True.*False with a selector"):
        _build("dflash2", sample_from_anchor=True)


def test_dpace_requires_ce():
    with pytest.raises(ValueError, match=r"loss='kl_div'.*exactly 'ce'.*dpace"):
        _build("dflash", loss="kl_div", position_weighting="dpace")


def test_block_size_below_two_rejected():
    with pytest.raises(ValueError, match=r"block_size=1.*>= 2"):
        SharedKnobs(block_size=1).validate()


def test_target_layer_ids_outside_target_rejected():
    with pytest.raises(ValueError, match=r"target_layer_ids=\[2, 8\].*\[1, 7\] for a target with 8 layers"):
        _build("dflash", target_layer_ids=[2, 8])
    with pytest.raises(ValueError, match=r"target_layer_ids=\[0, 3\]"):
        _build("dflash", target_layer_ids=[0, 3])


def test_unknown_loss_rejected():
    with pytest.raises(ValueError, match=r"loss='bogus'"):
        _build("dflash", loss="bogus", position_weighting="fixed-exp-decay")


def test_precision_knob_is_validated_and_drives_autocast(monkeypatch):
    from harness import devices
    from harness.config import TrainConfig

    with pytest.raises(ValueError, match="invalid knob precision='fp16'"):
        TrainConfig(precision="fp16").validate()
    with devices.autocast("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for native_bf16 in (False, True):  # `auto` follows the CPU's flags, whatever this machine's are
        monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda native=native_bf16: native)
        with devices.autocast("cpu", "auto"):
            assert torch.is_autocast_enabled("cpu") == native_bf16
        with devices.autocast("cpu", "fp32"):
            assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("knob", "section"),
    [("selector_loss_alpha", "algo"), ("decay_gamma", "shared"), ("dpace_alpha", "shared")],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_float_knobs_reject_nan_and_inf(knob, section, value):
    with pytest.raises(ValueError, match=rf"invalid knob {knob}=(nan|inf): allowed a finite number"):
        tiny_config("dflash2", **{knob: value}).validate()


def test_train_and_data_knobs_reject_nan_and_unknown_keys():
    from harness.config import RunConfig, TrainConfig

    with pytest.raises(ValueError, match=r"invalid knob learning_rate=nan: allowed a finite number"):
        TrainConfig(learning_rate=float("nan")).validate()
    with pytest.raises(ValueError, match=r"invalid knob train.max_stepz=3: allowed knobs \[.*'max_steps'"):
        RunConfig.from_dict({"algorithm": "dflash", "train": {"max_stepz": 3}})


@pytest.mark.parametrize(
    ("section", "knob", "value", "allowed"),
    [
        ("train", "max_steps", True, "an integer"),  # YAML `true` is a bool, never a step count
        ("train", "max_steps", 4.5, "an integer"),
        ("train", "seed", "1", "an integer"),
        ("train", "learning_rate", False, "a number"),
        ("train", "schedule", 3, "a string"),
        ("data", "regenerate", 1, "true or false"),
        ("shared", "target_layer_ids", [1, "x"], "a list of integers or none"),
        ("shared", "mask_token_id", 1.0, "an integer or none"),
        ("shared", "loss", {"ce": True}, "a string or a mapping"),
    ],
)
def test_every_knob_value_must_have_its_declared_type(section, knob, value, allowed):
    from harness.config import RunConfig

    data = RunConfig(AlgorithmConfig.preset("dflash2")).to_dict()
    data[section][knob] = value
    with pytest.raises(ValueError, match=f"^invalid knob {knob}=.*: allowed {allowed}$"):
        RunConfig.from_dict(data).validate()


def test_an_integer_is_a_valid_float_knob_and_none_a_valid_optional():
    from harness.config import RunConfig

    data = RunConfig(AlgorithmConfig.preset("dflash2")).to_dict()
    data["train"]["learning_rate"], data["shared"]["target_layer_ids"] = 1, None
    RunConfig.from_dict(data).validate()


def test_the_target_computes_features_in_fp32_on_any_cpu(monkeypatch):
    """A CPU's feature cache holds the same features whether or not the CPU has native bf16."""
    from harness import devices
    from harness.features import target_precision

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    with target_precision(torch.nn.Linear(2, 2)):
        assert not torch.is_autocast_enabled("cpu")
    with target_precision(torch.nn.Linear(2, 2), "bf16"):  # asked for, as the precision benchmark compares
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_feature_precision_resolves_per_device_and_keys_the_cache_only_when_bf16(monkeypatch, native):
    """`device` keeps every CPU at fp32 (one cache for all), `auto` follows native bf16, an explicit value is kept;
    an fp32 cache keeps the key it had before the compute dtype was part of it, and a bf16 one gets its own."""
    from harness import devices
    from harness.features import cache_key, feature_compute_dtype

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    cpu = torch.nn.Linear(2, 2)
    found = {p: feature_compute_dtype(cpu, p) for p in ("device", "auto", "bf16", "fp32")}
    assert found == {"device": "fp32", "auto": "bf16" if native else "fp32", "bf16": "bf16", "fp32": "fp32"}
    key = ("t", "d", [2, 15], 256, torch.float32)
    assert cache_key(*key, "fp32") == cache_key(*key) != cache_key(*key, "bf16")


def test_relative_difference_is_per_layer_over_the_tokens():
    """Two tokens, two layers of width 2 side by side: layer 0 off by (3, 4) on one token of norm 10 in all, layer 1
    exact."""
    from harness.features import relative_difference

    reference = torch.tensor([[6.0, 0.0, 1.0, 1.0], [0.0, 8.0, 1.0, 1.0]])
    found = reference + torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert relative_difference(found, reference, 2) == pytest.approx([0.5, 0.0])
