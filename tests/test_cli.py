"""The command line: help everywhere, clear knob errors, and the Qwen3-8B recipe's dry run against spec §8 shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "harness.cli"]


def _run(args, **kwargs):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **kwargs.pop("env", {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kwargs)


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["train"],
        ["prepare"],
        ["export"],
        ["evaluate"],
        ["study"],
        ["study", "launch"],
        ["study", "status"],
        ["study", "list"],
        ["report"],
    ],
)
def test_every_command_has_help(command):
    done = _run([*CLI, *command, "--help"])
    assert done.returncode == 0 and "usage: dflash-lab" in done.stdout and "-h, --help" in done.stdout


def test_bad_knob_on_the_command_line_names_knob_value_and_range():
    done = _run(
        [
            *CLI,
            "train",
            "--algorithm",
            "dflash2",
            "--conv-kernel-size",
            "9",
            "--dry-run",
            "--target",
            "tests/data/qwen3-8b",
        ]
    )
    assert done.returncode != 0
    assert "invalid knob conv_kernel_size=9: allowed an integer in [1, block_size=8]" in done.stderr


def test_bad_study_file_names_the_field(tmp_path):
    study = (
        (ROOT / "studies" / "default.yaml")
        .read_text()
        .replace("selector_top_k: [8, 16]", "selector_top_k: {type: int, low: 16, high: 8}")
    )
    path = tmp_path / "bad.yaml"
    path.write_text(study)
    done = _run([*CLI, "study", "launch", str(path), "--workdir", str(tmp_path)])
    assert (
        done.returncode != 0
        and "invalid field search_space.selector_top_k.low/high=(16, 8): allowed numbers with low <= high"
        in done.stderr
    )


def test_qwen3_8b_recipe_dry_run_matches_spec_shapes():
    done = _run(
        ["bash", "examples/train/dflash2_qwen3_8b_ultrachat.sh", "--dry-run"], env={"TARGET": "tests/data/qwen3-8b"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    shapes = report["tensor_shapes"]
    hidden, vocab, layers = 4096, 151936, 5
    assert len(shapes) == 15 * layers + 6 == 81
    assert shapes["fc.weight"] == [hidden, 3 * hidden]
    assert shapes["layers.0.self_attn.q_proj.weight"] == [32 * 128, hidden]
    assert shapes["layers.0.self_attn.k_proj.weight"] == [8 * 128, hidden]
    assert shapes["layers.0.self_attn.q_norm.weight"] == [128]
    assert shapes["layers.4.mlp.gate_proj.weight"] == [12288, hidden]
    assert shapes["layers.4.mlp.down_proj.weight"] == [hidden, 12288]
    assert shapes["layers.0.attention_conv.base_kernel"] == [2, 2, hidden]
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == [2 * 2 * hidden // 16, hidden]
    assert (
        shapes["candidate_selector.predecessor_codebook"]
        == shapes["candidate_selector.successor_codebook"]
        == [vocab, 256]
    )
    assert shapes["candidate_selector.hidden_projection.weight"] == [256, hidden]
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in shapes)
    config = report["checkpoint_config"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 17, 32] and config["aux_hidden_state_layer_ids"] == [
        2,
        18,
        33,
    ]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1000000.0
    assert report["config"]["shared"]["max_anchors"] == 640 and report["config"]["train"]["learning_rate"] == 3e-4
