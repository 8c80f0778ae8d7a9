"""Real targets: RoPE scaling as the target's config states it, reproduced by the draft, refused when it cannot be."""

from pathlib import Path

import pytest
import torch

from algorithms import build_draft
from algorithms.modeling import rope_inverse_frequencies, rotary_cos_sin
from harness.targets import load_target

from conftest import LLAMA3_ROPE, one_line, tiny_config, tiny_llama

LINEAR = {"rope_type": "linear", "factor": 2.0}


def test_llama3_frequencies_by_hand():
    # head_dim 4, theta 100: frequencies 1 and 0.1, wavelengths 2*pi and 20*pi; band (4, 16) positions.
    # 2*pi lies in the band: blend (16 / 2*pi - 1) / 3 of the kept frequency, the rest slowed by 4.
    # 20*pi lies past it: slowed by 4.
    blend = (16 / (2 * torch.pi) - 1) / 3
    expected = torch.tensor([blend * 1.0 + (1 - blend) * 1.0 / 4, 0.1 / 4])
    assert torch.allclose(rope_inverse_frequencies(4, 100.0, LLAMA3_ROPE), expected)
    assert torch.allclose(rope_inverse_frequencies(4, 100.0, LINEAR), torch.tensor([0.5, 0.05]))
    assert torch.allclose(rope_inverse_frequencies(4, 100.0, None), torch.tensor([1.0, 0.1]))


def saved_target(directory, **config) -> str:
    """A tiny random Llama and a word-level tokenizer, saved as a user's own target directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    tiny_llama(**config).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"<unk>": 100}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="w0").save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("scaling", [LLAMA3_ROPE, LINEAR], ids=["llama3", "linear"])
def test_a_rope_scaled_target_loads_and_the_draft_rotates_as_it_does(tmp_path, scaling):
    target = load_target(saved_target(tmp_path / "target", rope_scaling=dict(scaling)), tmp_path)
    assert target.spec.rope_scaling == scaling
    positions = torch.arange(40)
    theirs_cos, theirs_sin = target.model.model.rotary_emb(torch.zeros(1, 40, 1), positions[None])
    ours_cos, ours_sin = rotary_cos_sin(
        positions, target.spec.head_dim, target.spec.rope_theta, torch.float32, target.spec.rope_scaling
    )
    assert torch.allclose(ours_cos, theirs_cos[0], atol=1e-6) and torch.allclose(ours_sin, theirs_sin[0], atol=1e-6)
    unscaled, _ = rotary_cos_sin(positions, target.spec.head_dim, target.spec.rope_theta, torch.float32)
    assert not torch.allclose(unscaled, theirs_cos[0], atol=1e-3)  # the scaling matters at these positions


def test_a_rope_the_draft_cannot_reproduce_is_refused_in_one_line(cli, capsys, tmp_path):
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    target = saved_target(tmp_path / "target", rope_scaling=yarn)
    capsys.readouterr()  # saving's progress bars are not the command's
    line = one_line(cli(["train", "--target", target, "--workdir", str(tmp_path / "work"), "--dry-run"]))
    assert line == (
        f"error: invalid --target='{target}': its RoPE is rope_type='yarn'; allowed ['default', 'linear', 'llama3'] "
        "(the draft cannot reproduce attention rescaling or length-dependent RoPE)"
    )


def test_a_target_loads_in_bf16_on_an_accelerator_and_fp32_on_the_cpu(tmp_path):
    """On the accelerator stand-in the weights load as bf16 (tests/test_accelerator_standin.py trains on such a
    target); on the CPU as fp32, the served agreement's precision. The draft's frozen copies are fp32 either way."""
    directory = saved_target(tmp_path / "target")
    on_accelerator, on_cpu = load_target(directory, tmp_path, device="meta"), load_target(directory, tmp_path)
    assert {p.dtype for p in on_accelerator.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in on_accelerator.model.parameters()} == {"meta"}
    assert {p.dtype for p in on_cpu.model.parameters()} == {torch.float32}
    assert on_accelerator.spec == on_cpu.spec and on_accelerator.weights_hash == on_cpu.weights_hash
    draft = build_draft(
        tiny_config("dflash"), on_accelerator.spec, on_accelerator.embed_weight, on_accelerator.head_weight
    )
    assert draft.head_weight.dtype == draft.embed_weight.dtype == torch.float32


def test_a_hub_revision_pin_loads_that_revision(tmp_path):
    """`org/name@REVISION` loads that snapshot, not the branch head; the pin stays in the target's name. Hub
    snapshots are laid out as huggingface_hub caches them, and the hub is never reached (offline mode)."""
    import os
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--me--tiny"
    pinned, head = "a" * 40, "b" * 40
    saved_target(repo / "snapshots" / pinned)
    saved_target(repo / "snapshots" / head, num_hidden_layers=4)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(head)
    script = (
        "import sys; from pathlib import Path; from harness.targets import load_target\n"
        "for name in sys.argv[2:]:\n"
        "    target = load_target(name, Path(sys.argv[1]))\n"
        "    print(target.name, target.spec.num_hidden_layers)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), f"me/tiny@{pinned}", "me/tiny", "me/tiny@main"],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert result.stdout.split("\n")[:3] == [f"me/tiny@{pinned} 8", "me/tiny 4", "me/tiny@main 4"], result.stderr
