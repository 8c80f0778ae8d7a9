"""The command line: help everywhere, clear knob errors, and the Qwen3-8B recipe's dry run against export shapes."""

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
        ["serve"],
        ["study"],
        ["study", "launch"],
        ["study", "status"],
        ["study", "list"],
        ["report"],
    ],
)
def test_every_command_has_help(cli, command):
    done = cli([*command, "--help"])
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


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--nproc-per-node", "0", "error: invalid --nproc-per-node=0: allowed an integer >= 1"),
        ("--collective-timeout", "0", "error: invalid --collective-timeout=0.0: allowed seconds > 0"),
    ],
)
def test_bad_rank_options_name_flag_value_and_range(cli, tmp_path, flag, value, message):
    done = cli(["train", "--target", "tests/data/qwen3-8b", "--workdir", str(tmp_path), flag, value])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == message


def test_bad_study_file_names_the_field(cli, tmp_path):
    study = (
        (ROOT / "studies" / "search.yaml")
        .read_text()
        .replace("candidate_top_k: [8, 16]", "candidate_top_k: {type: int, low: 16, high: 8}")
    )
    path = tmp_path / "bad.yaml"
    path.write_text(study)
    done = cli(["study", "launch", str(path), "--workdir", str(tmp_path)])
    assert (
        done.returncode != 0
        and "invalid field search_space.candidate_top_k.low/high=(16, 8): allowed numbers with low <= high"
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
    # the feature cache this recipe would need: 50,000 conversations of at most 256 tokens, by hand; the target
    # is bf16, so its final hidden state is stored in bf16 too (3 layers x 2 bytes + 2 bytes per hidden unit)
    cache = report["feature_cache"]
    assert cache["tokens_at_most"] == 50_000 * 256
    assert cache["final_hidden_dtype"] == "bfloat16"
    assert cache["bytes_at_most"] == 50_000 * 256 * hidden * (3 * 2 + 2) == 419_430_400_000
    assert ("warning" in cache) == (cache["bytes_at_most"] > cache["free_gib"] * 2**30)
    if "warning" in cache:
        assert "--features online" in cache["warning"] and "--features online" in done.stderr
    config = report["checkpoint_config"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 17, 32] and config["aux_hidden_state_layer_ids"] == [
        2,
        18,
        33,
    ]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1000000.0
    assert report["config"]["shared"]["max_anchors"] == 640 and report["config"]["train"]["learning_rate"] == 3e-4


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--target-layer-ids", "a,b"],
            "invalid knob target_layer_ids='a,b': allowed a comma-separated list of integers",
        ),
        (
            ["--target-layer-ids", "0,40"],
            "invalid knob target_layer_ids=[0, 40]: allowed distinct ascending ids in [1, 35]",
        ),
        (["--selector-loss-alpha", "nan"], "invalid knob selector_loss_alpha='nan': allowed a finite number"),
        (["--lr", "inf"], "invalid knob learning_rate='inf': allowed a finite number"),
        (["--dflash-decay-gamma", "nan"], "invalid knob decay_gamma='nan': allowed a finite number"),
        (["--block-attention", "sideways"], "invalid knob block_attention='sideways': allowed one of ['bidirectional'"),
        (["--max-steps", "ten"], "invalid knob max_steps='ten': allowed an integer"),
        (["--conv-group-size", "7"], "invalid knob conv_group_size=7: allowed a divisor of the hidden size 4096"),
        (["--candidate-top-k", "0"], "invalid knob candidate_top_k=0: allowed an integer >= 1"),
        (["--algorithm", "dflash", "--selector-rank", "8"], "invalid knob knobs.selector_rank=8: allowed knobs []"),
        (["--candidate-top-k", "600000"], "invalid knob candidate_top_k=600000: allowed an integer in [1, vocab_size="),
        (["--draft-vocab-size", "100"], "invalid knob draft_vocab_size=100: allowed the full verifier vocabulary"),
    ],
)
def test_generated_knob_flags_fail_with_one_clear_line(cli, flags, message):
    done = cli(["train", *flags, "--dry-run", "--target", "tests/data/qwen3-8b"])
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_knob_flags_carry_type_choices_and_help():
    done = _run([*CLI, "train", "--help"])
    help_text = " ".join(done.stdout.split())
    assert "--conv-kernel-size INT conv taps over earlier slots" in help_text
    assert "--block-attention {bidirectional,causal}" in help_text
    assert "--target-layer-ids INT,INT,...|none" in help_text
    assert "--sample-from-anchor, --no-sample-from-anchor" in help_text
    assert "--algorithm {dflash,dflash+conv,dflash+selector,dflash2,jetspec,domino,dspark}" in help_text


@pytest.mark.parametrize("algorithm", ["dflash+conv", "dflash+selector"])
def test_component_variants_dry_run_and_export_as_dflash2(cli, algorithm):
    """Each variant trains only its own component, and is written as DFlash2 with the other one neutral: the null
    selector (one candidate: the unary walk) or the identity conv (one tap over one group)."""
    done = cli(["train", "--algorithm", algorithm, "--dry-run", "--target", "tests/data/qwen3-8b"])
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["config"]["algorithm"] == algorithm
    has_conv = any("conv" in name for name in plan["tensor_shapes"])
    has_selector = any(name.startswith("candidate_selector") for name in plan["tensor_shapes"])
    assert (has_conv, has_selector) == ((True, False) if algorithm == "dflash+conv" else (False, True))
    exported = plan["checkpoint_config"]
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["speculators_model_type"] == "dflash2"
    if algorithm == "dflash+conv":
        assert (exported["selector_rank"], exported["selector_top_k"], exported["conv_kernel_size"]) == (1, 1, 2)
    else:
        assert (exported["conv_kernel_size"], exported["conv_group_size"]) == (1, exported["hidden_size"])


def test_config_file_sets_algorithm_and_an_explicit_flag_beats_it(cli, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("algorithm: dflash+conv\nknobs: {conv_kernel_size: 3}\ntrain: {max_steps: 7}\n")
    common = ["train", "--config", str(config), "--dry-run", "--target", "tests/data/qwen3-8b"]
    plan = json.loads(cli(common).stdout)["config"]
    assert (plan["algorithm"], plan["knobs"]["conv_kernel_size"], plan["train"]["max_steps"]) == ("dflash+conv", 3, 7)
    plan = json.loads(cli([*common, "--conv-kernel-size", "2", "--max-steps", "9"]).stdout)["config"]
    assert (plan["knobs"]["conv_kernel_size"], plan["train"]["max_steps"]) == (2, 9)


def _fingerprint(workdir: Path) -> dict:
    """What a command could change in a work directory: every file's checksum, and what the stores hold (runs
    and their states, metric rows, duplicate (run, key, step) rows, trials and their states), read read-only."""
    import hashlib
    import sqlite3

    def rows(database: Path, query: str) -> list[tuple]:
        if not database.exists():
            return []
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
            return sorted(connection.execute(query).fetchall())

    mlflow_db, optuna_db = workdir / "mlflow.db", workdir / "optuna.db"
    return {
        "files": {
            str(path.relative_to(workdir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(workdir.rglob("*"))
            if path.is_file()
        },
        "runs": rows(mlflow_db, "SELECT run_uuid, status, lifecycle_stage FROM runs"),
        "metric_rows": rows(mlflow_db, "SELECT COUNT(*) FROM metrics"),
        "duplicate_rows": rows(
            mlflow_db, "SELECT COUNT(*) FROM (SELECT 1 FROM metrics GROUP BY run_uuid, key, step HAVING COUNT(*) > 1)"
        ),
        "trials": rows(optuna_db, "SELECT trial_id, state FROM trials"),
    }


@pytest.fixture(scope="module")
def populated_workdir(tmp_path_factory) -> Path:
    """A work directory as users have them: an MLflow store with a finished run and its metrics, an Optuna
    study with a finished trial, and a run directory whose checkpoint is damaged."""
    import mlflow
    import optuna

    workdir = tmp_path_factory.mktemp("populated")
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("dflash-lab/runs"), run_name="kept")
    for step in range(3):
        client.log_metric(run.info.run_id, "accept/realized", 1.0 + step, step=step)
    client.set_terminated(run.info.run_id)
    study = optuna.create_study(study_name="kept", storage=f"sqlite:///{workdir / 'optuna.db'}")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    (workdir / "runs" / "kept").mkdir(parents=True)
    (workdir / "runs" / "kept" / "checkpoint.pt").write_bytes(b"checkpoint")
    return workdir


BAD_FILES = {
    "syntax.yaml": "train: [max_steps: 3\n",
    "word_steps.yaml": "train: {max_steps: ten}\n",
    "fractional_steps.yaml": "train: {max_steps: 4.5}\n",
    "bool_steps.yaml": "train: {max_steps: true}\n",
    "fractional_seed.yaml": "train: {seed: 1.5}\n",
    "bad_line.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n',
    "binary.jsonl": "\x00\x01\x02\x03\n",
    "twice_seeded.yaml": (ROOT / "tests" / "data" / "tiny_design.yaml")
    .read_text()
    .replace("seeds: [0, 1]", "seeds: [0, 0]"),
}


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["train", "--device", "cuda"], {}, "invalid --device='cuda': allowed cpu"),
        (["train", "--target", "does/not/exist"], {}, "invalid --target='does/not/exist': not found"),
        (["train", "--target", "tests"], {}, "invalid --target='tests': a directory without config.json"),
        (["train", "--max-steps", "2"], {"MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}, "no MLflow server answered"),
        (
            ["study", "launch", "studies/default.yaml", "--storage", "postgresql://nobody@127.0.0.1:1/none"],
            {},
            "connection",
        ),
        (["export", "no-such-run"], {}, "no checkpoint for run 'no-such-run'"),
        (
            ["evaluate", "kept", "--prompts", "no-such.jsonl"],
            {},
            'invalid --prompts=\'no-such.jsonl\': no such file; allowed a JSONL file of {"prompt": "..."} per line',
        ),
        (
            ["evaluate", "kept", "--confidence-threshold", "1.5"],
            {},
            "argument --confidence-threshold: '1.5'; allowed a number in [0, 1]",
        ),
        (
            ["train", "--algorithm", "dspark", "--markov-rank", "0"],
            {},
            "invalid knob markov_rank=0: allowed an integer",
        ),
        (["train", "--run-name", "../../x"], {}, "invalid --run-name='../../x': allowed 1-200 letters"),
        (["train", "--run-name", "/abs/path"], {}, "invalid --run-name='/abs/path': allowed"),
        (["train", "--run-name", ".."], {}, "invalid --run-name='..': allowed"),
        (["train", "--run-name", "x" * 300], {}, "invalid --run-name='xxxxxxxx"),
        (["export", "kept"], {}, "checkpoint.pt is unreadable (UnpicklingError"),
        (["train", "--config", "{files}/syntax.yaml"], {}, "syntax.yaml: not valid YAML (line 2, column 1)"),
        (
            ["train", "--config", "{files}/word_steps.yaml"],
            {},
            "word_steps.yaml: invalid knob max_steps='ten': allowed an integer",
        ),
        (["train", "--config", "{files}/fractional_steps.yaml"], {}, "invalid knob max_steps=4.5: allowed an integer"),
        (["train", "--config", "{files}/bool_steps.yaml"], {}, "invalid knob max_steps=True: allowed an integer"),
        (["train", "--config", "{files}/fractional_seed.yaml"], {}, "invalid knob seed=1.5: allowed an integer"),
        (["train", "--data", "{files}/bad_line.jsonl"], {}, "bad_line.jsonl': line 2 is not JSON (Expecting value)"),
        (["train", "--data", "{files}/binary.jsonl"], {}, "binary.jsonl': line 1 is not JSON"),
        (
            ["study", "launch", "{files}/twice_seeded.yaml"],
            {},
            "invalid field seeds=[0, 0]: allowed a non-empty list of distinct integers",
        ),
    ],
)
def test_bad_input_ends_in_one_error_line_exit_2_and_leaves_the_workdir_alone(
    cli, populated_workdir, tmp_path, args, env, message
):
    import shutil

    workdir, files = tmp_path / "work", tmp_path / "files"
    shutil.copytree(populated_workdir, workdir)
    files.mkdir()
    for name, text in BAD_FILES.items():
        (files / name).write_text(text)
    before = _fingerprint(workdir)
    assert before["runs"] and before["metric_rows"] == [(3,)] and before["trials"]
    done = cli([*(arg.format(files=files) for arg in args), "--workdir", str(workdir)], env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert _fingerprint(workdir) == before


@pytest.mark.parametrize("built", ["whole", "up to its first draw", "collected before the error"])
def test_an_error_after_an_unfinished_progress_bar_starts_its_own_line(capsys, monkeypatch, built):
    """A Ctrl-C inside tqdm's constructor (after its first draw) leaves a bar that no `with` block ends; the error
    once ran on into the bar's line ('... 0/240 [00:00<?, ?turn/s]error: interrupted'), as CI saw, twice: the
    second time the half-built bar had already left tqdm's registry, so only stderr itself knew its line was open."""
    from tqdm.auto import tqdm

    from harness.cli import print_error, track_stderr_lines

    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after the test
    track_stderr_lines()
    bar = tqdm(total=240, desc="regenerating responses", unit="turn", file=sys.stderr)
    if built != "whole":
        del bar.start_t  # the constructor sets it last, after the first draw
    if built == "collected before the error":
        tqdm._instances.remove(bar)
    print_error("error: interrupted (Ctrl-C)")
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "error: interrupted (Ctrl-C)"
    assert lines[-2].startswith("regenerating responses:   0%")
    assert bar not in tqdm._instances
    bar.disable = True  # a half-built bar's own __del__ would fail on the missing start_t when collected


def test_version_names_the_installed_package(cli):
    import importlib.metadata

    done = cli(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"dflash-lab {importlib.metadata.version('dflash-lab')}"


def test_a_launch_whose_trials_failed_exits_non_zero_with_a_one_line_count(cli, monkeypatch, tmp_path):
    """The summary, the MLflow line and the rebuild hint come first; the last line counts the failures (an
    interrupted trial, which runs again, is not one: studies.runner.failed_trials)."""
    import studies.runner

    summary = {"study": "tiny", "trials": {"complete": 2, "fail": 1}, "failed_trials": {1: "RuntimeError: boom\nmore"}}
    monkeypatch.setattr(studies.runner, "launch", lambda *args, **kwargs: summary)
    done = cli(["study", "launch", "tests/data/tiny_study.yaml", "--workdir", str(tmp_path), "--no-report"])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: 1 of 3 trials of study tiny failed (trial 1: RuntimeError: boom); `dflash-lab study status tiny` "
        "lists them with their reasons"
    )
    assert "Regenerate the report any time with" in done.stdout
