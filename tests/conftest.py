"""Tiny random targets and packed rows for CPU unit tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from algorithms import AlgorithmConfig, TargetSpec, build_draft
from algorithms.blocks import PackedRow, sample_anchors

VOCAB, HIDDEN, TARGET_LAYERS = 300, 64, 8
# Llama 3.1's scaling, shrunk so that a tiny head's frequencies fall on all three sides of the blend band
# (wavelengths 6.3, 20, 63, ... against a band from 16 / 4 = 4 to 16 / 1 = 16 positions).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_target(**overrides) -> TargetSpec:
    fields = dict(
        num_hidden_layers=TARGET_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return TargetSpec(**fields)


def tiny_llama(**overrides):
    """A random Llama verifier with tiny_target()'s shapes (seed torch before calling it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = tiny_target()
    fields = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
    )
    config = LlamaConfig(**{**fields, **overrides})
    return LlamaForCausalLM(config)


def tiny_config(algorithm: str, **overrides) -> AlgorithmConfig:
    config = AlgorithmConfig.preset(algorithm, mask_token_id=5, num_draft_layers=2, block_size=4, max_anchors=8)
    small = {
        k: v
        for k, v in dict(
            conv_group_size=8, selector_rank=8, candidate_top_k=4, domino_rank=8, domino_gru_size=16, markov_rank=8
        ).items()
        if k in config.knob_names()
    }
    return config.replace(**{**small, **overrides})


def frozen_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
    head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
    return embed, head


def tiny_draft(algorithm: str, seed: int = 0, **overrides):
    """`seed` drives the trainable init; the frozen verifier tensors are always the same."""
    torch.manual_seed(seed)
    embed, head = frozen_tensors()
    return build_draft(tiny_config(algorithm, **overrides), tiny_target(), embed, head)


def packed_row(doc_lengths=(20, 14), pad: int = 6, seed: int = 0, num_features: int = 3) -> PackedRow:
    """Packed documents plus padding; the first 3 tokens of each document are prompt (mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    length = sum(doc_lengths) + pad
    document_ids = torch.full((length,), -1, dtype=torch.long)
    position_ids = torch.zeros(length, dtype=torch.long)
    loss_mask = torch.zeros(length)
    start = 0
    for doc, size in enumerate(doc_lengths):
        document_ids[start : start + size] = doc
        position_ids[start : start + size] = torch.arange(size)
        loss_mask[start + 3 : start + size] = 1
        start += size
    input_ids = torch.randint(0, VOCAB, (length,), generator=generator) * (document_ids != -1)
    return PackedRow(
        input_ids=input_ids,
        loss_mask=loss_mask,
        document_ids=document_ids,
        position_ids=position_ids,
        features=torch.randn(length, num_features * HIDDEN, generator=generator),
        target_hidden=torch.randn(length, HIDDEN, generator=generator),
    )


@pytest.fixture
def row() -> PackedRow:
    return packed_row()


def fitted(draft, row: PackedRow, anchors, steps: int = 25):
    """`draft` after a few Adam steps on the row: heads move off their zero start, and drafts get accepted
    (accepted lengths more than the anchor alone)."""
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        draft.training_forward(row, anchors).loss.backward()
        optimizer.step()
    optimizer.zero_grad()
    return draft


def anchors_for(row: PackedRow, block_size: int = 4, max_anchors: int = 8, seed: int = 0):
    return sample_anchors(row.loss_mask, row.document_ids, block_size, max_anchors, torch.Generator().manual_seed(seed))


# ---- the embedded real target (slow tests) --------------------------------------------------------

E2E_CACHES = ("targets", "data", "features")  # what a work directory shares with another on the same inputs


TINY_STUDY = Path(__file__).parent / "data" / "tiny_study.yaml"
CLI = [sys.executable, "-m", "harness.cli"]


def tiny_study_file(tmp_path: Path, name: str, **replacements) -> Path:
    """The tiny study renamed `name`, with no best trial evaluated and each text replacement made."""
    text = (
        TINY_STUDY.read_text()
        .replace("name: tiny", f"name: {name}")
        .replace("evaluate: {best_trials: 1", "evaluate: {best_trials: 0")
    )
    for old, new in replacements.items():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def launch_study(study_file: Path, workdir: Path, *extra: str, cwd: Path, env=None, **kwargs):
    """`dflash-lab study launch` as a subprocess in `cwd`; its completed process."""
    return subprocess.run(
        [*CLI, "study", "launch", str(study_file), "--workdir", str(workdir), *extra],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=900,
        **kwargs,
    )


def link_caches(workdir, source) -> None:
    """Give `workdir` the converted target, data and feature caches of `source`, as links."""
    workdir.mkdir(parents=True, exist_ok=True)
    for cache in E2E_CACHES:
        if not (workdir / cache).exists():
            (workdir / cache).symlink_to(source / cache)


@pytest.fixture(autouse=True)
def tracking_uri_left_as_found():
    """Every test starts with the MLFLOW_TRACKING_URI it found: MLflow exports a URI it is given to the
    environment, and in a shared pytest-xdist worker one test's store would become the next one's."""

    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") != before:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before
        mlflow.set_tracking_uri(before or "")
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)


# The order CI's two workers take whole files in (`--dist loadfile --no-loadscope-reorder`): the longest
# first, by their measured times, so that no long file starts last and runs alone while the other worker
# idles; except that the two files needing no end-to-end caches come second, to keep the other worker busy
# while the first one builds them (the rest, short unit files, fill the end).
@pytest.fixture
def cli(capsys, monkeypatch):
    """`dflash-lab ARGS` run in this process, by the same `main` the console script calls: it returns what
    `_run` does (returncode, stdout, stderr) without a new interpreter's imports, which are most of a
    refusal's cost. An exception that escapes `main` fails the test with its traceback. Tests of what only a
    real process shows (signals, the console script itself) keep `_run`."""
    import signal

    from harness.cli import main

    monkeypatch.chdir(Path(__file__).parent.parent)

    def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        sigterm = signal.getsignal(signal.SIGTERM)  # main installs its preemption handler
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse: --help, usage errors
            code = stop.code
        finally:
            signal.signal(signal.SIGTERM, sigterm)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run


FILE_ORDER = (
    "test_study_designs_e2e.py",
    "test_studies_e2e.py",
    "test_cli.py",
    "test_tracking.py",
    "test_decode_e2e.py",
    "test_distributed.py",
    "test_harness_e2e.py",
    "test_gpu_check.py",
)


def one_line(result) -> str:
    """A refusal's stderr: exit status 2 and one line, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def pytest_collection_modifyitems(config, items):
    rank = {name: place for place, name in enumerate(FILE_ORDER)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    """Each pytest-xdist worker (CI runs two on two cores) computes on one thread, as do the commands it starts."""

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def e2e_run_config(algorithm: str = "dflash2", max_anchors: int = 8, **train_overrides):
    """The small preset, shrunk further so end-to-end tests fit CI; real target, real data. Training and
    validation cost scale with the anchors per row: 8 serve the tests that check plumbing; the learning test
    (`trained`) and the distributed tests take 16."""
    import dataclasses

    from harness.presets import preset_run

    config = preset_run("small", algorithm, "smollm2-135m")
    config.data = dataclasses.replace(
        config.data, num_conversations=40, num_validation=8, max_new_tokens=48, row_length=512, max_length=192
    )
    config.algorithm = config.algorithm.replace(max_anchors=max_anchors)
    # The final validation reads at most 8 evenly spaced anchors per document (64 of about 233): the tests that
    # read it check its plumbing, not its precision; the learning test (`trained`) reads every anchor.
    shrunk = {"max_steps": 4, "eval_every": 2, "log_every": 1, "checkpoint_every": 2, "final_validation_cap": 8}
    config.train = dataclasses.replace(config.train, **{**shrunk, **train_overrides})
    return config


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory):
    """One work directory per session (DFLASH_LAB_TEST_WORKDIR reuses one across sessions)."""
    from pathlib import Path

    reuse = os.environ.get("DFLASH_LAB_TEST_WORKDIR")
    return Path(reuse) if reuse else tmp_path_factory.mktemp("work")


@pytest.fixture(scope="session")
def e2e_workspace(e2e_workdir, tmp_path_factory):
    """The target, data and features of e2e_run_config. Under pytest-xdist the caches are built once, by the
    first worker to get here (the others wait on a lock), and linked into every worker's work directory."""
    import fcntl

    from harness.train import prepare_workspace

    if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("DFLASH_LAB_TEST_WORKDIR"):
        shared = tmp_path_factory.getbasetemp().parent / "e2e-caches"
        shared.mkdir(exist_ok=True)
        with open(shared / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            prepare_workspace(e2e_run_config(), shared)
        link_caches(e2e_workdir, shared)
    return prepare_workspace(e2e_run_config(), e2e_workdir)


# The members the learning and lossless end-to-end tests train; DFLASH_LAB_FAMILY_E2E=1 adds the family's
# other members (three more 60-step trainings and decodes: past CI's time budget).
E2E_MEMBERS = ("dflash2", "dflash") + (
    ("jetspec", "domino", "dspark") if os.environ.get("DFLASH_LAB_FAMILY_E2E") else ()
)


@pytest.fixture(scope="session")
def trained(e2e_workspace):
    """60 steps of the small preset per algorithm on real data (shared by the learning and decoding tests)."""
    from harness.train import train

    return {
        algorithm: train(
            e2e_run_config(
                algorithm,
                max_anchors=16,
                max_steps=60,
                eval_every=60,
                checkpoint_every=60,
                log_every=20,
                final_validation_cap=0,
            ),
            e2e_workspace,
            run_name=f"learns-{algorithm}",
        )
        for algorithm in E2E_MEMBERS
    }


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, *options: str):
    """A real `mlflow server` on a free local port, in its own process group; yields (url, process)."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from harness.serving.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    server = subprocess.Popen(
        [*command, "--backend-store-uri", backend_store_uri, *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # no job runner: seven consumer processes (5 s of CPU each at start) that these tests never use
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "mlflow server did not start"
                time.sleep(0.5)
        yield url, server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has ended within `within_s`: none of its threads runs any more. A zombie leader
    counts only once its other threads have exited too: until the last one does, the process keeps its files and
    sockets (a killed llama-server's port still accepted a connection, then reset it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(_thread_state(task) in (None, "Z", "X") for task in _tasks(pid)):
            return True
        time.sleep(0.05)
    return False


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []  # the process is gone


def _thread_state(task: Path) -> str | None:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # that thread has exited


def child_running(pid: int, word: str, within_s: float = 600):
    """The first descendant of `pid` whose command line holds `word`, once it has one (a child between its fork
    and its exec has another command line, or none yet)."""
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if any(word in part for part in child.cmdline()):
                    return child
            except psutil.Error:  # gone, or a zombie, since it was listed
                continue
        time.sleep(0.02)
    raise AssertionError(f"no process running {word} was started by {pid}")


def started_server(workdir: Path, process: subprocess.Popen, log: Path | None = None, timeout_s: float = 600) -> dict:
    """The record (pid, port, owner) of the llama-server that `process` (a dflash-lab command) started in `workdir`,
    once it is recorded there and, with `log`, once that server's log shows a request being processed."""
    from harness.run import server_records

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the command ended ({process.returncode}) before its server started"
        for path in server_records(workdir).glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except FileNotFoundError:  # a server of the same command that stopped since the listing
                continue
            if record["owner"] == process.pid and (log is None or "launch_slot_" in _text(log)):
                return record
        time.sleep(0.05)
    raise AssertionError(f"no llama-server of process {process.pid} within {timeout_s} s")


@pytest.fixture
def spawn():
    """Popen for a test's dflash-lab commands, killed at teardown if still running, so that a failed assertion
    leaves no command behind to write into the shared workdir under the next test."""
    processes: list[subprocess.Popen] = []

    def start(args: list[str], **kwargs) -> subprocess.Popen:
        processes.append(subprocess.Popen(args, **kwargs))
        return processes[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
