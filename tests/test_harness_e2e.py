"""End-to-end checks on the embedded SmolLM2-135M target and real chitchat data."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import mlflow
import pytest
import torch

from harness import tracking
from harness.data import tokenize_conversation
from harness.devices import computes_in
from harness.features import CorruptFeatureCache, load_or_build
from harness.train import NonFiniteLoss, train

from conftest import e2e_run_config, link_caches, mlflow_server

pytestmark = pytest.mark.slow


def test_embedded_target_is_real(e2e_workspace):
    target = e2e_workspace.target
    spec = target.spec
    assert (
        spec.num_hidden_layers,
        spec.hidden_size,
        spec.vocab_size,
        spec.num_attention_heads,
        spec.num_key_value_heads,
    ) == (30, 576, 49152, 9, 3)
    assert spec.architectures == ["LlamaForCausalLM"]
    ids = target.tokenizer("The capital of France is")["input_ids"]
    assert target.tokenizer.decode(ids) == "The capital of France is"
    text = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert target.mask_token_id == 16 and "<empty_output>" in target.mask_token_reason
    # the dequantised model is a working LM: greedy continuation of a factual prompt
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    encoded = target.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = target.model.generate(**encoded, max_new_tokens=12, do_sample=False)
    assert "Paris" in target.tokenizer.decode(out[0, encoded["input_ids"].shape[1] :])


def test_the_converted_targets_config_reads_as_transformers_reads_it(e2e_workspace, e2e_workdir):
    """Dry runs and study launches parse the converted target's config.json without transformers."""
    from transformers import AutoConfig

    from harness.targets import native_dtype, target_config, target_spec

    parsed = target_config("smollm2-135m", e2e_workdir)
    loaded = AutoConfig.from_pretrained(e2e_workdir / "targets" / "smollm2-135m")
    assert not isinstance(parsed, type(loaded)), "the converted target's config must be parsed, not loaded"
    assert target_spec(parsed, "smollm2-135m") == target_spec(loaded, "smollm2-135m") == e2e_workspace.target.spec
    assert native_dtype(parsed) == native_dtype(loaded)


def test_a_bf16_feature_cache_is_its_own_and_lies_within_the_stated_tolerance_of_fp32_ones(e2e_workspace, tmp_path):
    """An accelerator's cache computes features in bf16, a CPU's in fp32 (`train.feature_precision: device`): on the
    real target and data a cache asked for in bf16 is keyed apart, says what it computed in, and each selected layer
    lies within BF16_FEATURE_TOLERANCE of the fp32 cache's, though not equal to it."""
    from harness.features import BF16_FEATURE_TOLERANCE, relative_difference

    target, documents = e2e_workspace.target, e2e_workspace.data.train[:4]
    layer_ids = e2e_run_config().algorithm.shared.resolve_target_layer_ids(target.spec.num_hidden_layers)
    built = {
        precision: load_or_build(target, documents, "four", layer_ids, 256, tmp_path, precision=precision)
        for precision in ("device", "fp32", "bf16")
    }
    (device, device_hit), (fp32, fp32_hit), (bf16, bf16_hit) = built.values()
    assert not device_hit and fp32_hit and fp32.directory == device.directory, "a CPU's default computes in fp32"
    assert not bf16_hit and bf16.directory != fp32.directory
    assert (fp32.manifest["computed_in"], bf16.manifest["computed_in"]) == ("fp32", "bf16")
    differences = [
        relative_difference(bf16.document(i)[0], fp32.document(i)[0], len(layer_ids)) for i in range(len(documents))
    ]
    assert max(max(d) for d in differences) <= BF16_FEATURE_TOLERANCE, differences
    assert min(min(d) for d in differences) > 0, "bf16 computed the same features as fp32: the knob is ignored"


def test_loss_mask_covers_assistant_tokens_only(e2e_workspace):
    tokenizer = e2e_workspace.target.tokenizer
    conversation = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "Hi! Nice day."},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    doc = tokenize_conversation(tokenizer, conversation, 512)
    supervised = tokenizer.decode([t for t, m in zip(doc.input_ids, doc.loss_mask, strict=True) if m])
    assert supervised == "Hi! Nice day.<|im_end|>\nGoodbye.<|im_end|>\n"
    unsupervised = tokenizer.decode([t for t, m in zip(doc.input_ids, doc.loss_mask, strict=True) if not m])
    assert "hello there" in unsupervised and "bye" in unsupervised and "Nice day" not in unsupervised
    # every real training document carries assistant supervision and some unsupervised prompt
    for document in e2e_workspace.data.train:
        assert 0 < sum(document.loss_mask) < len(document.input_ids)


def test_feature_cache_hit_runs_no_target_and_corruption_is_detected(e2e_workspace, e2e_workdir, tmp_path):
    ws = e2e_workspace
    layer_ids = ws.features.layer_ids
    documents = ws.data.validation + ws.data.train
    forward = mock.Mock(side_effect=AssertionError("the target must not run on a cache hit"))
    forward.parameters = lambda: iter([torch.zeros(1)])  # where it sits: the key holds what it computes in there
    with mock.patch.object(ws.target, "model", forward):
        cache, hit = load_or_build(
            ws.target, documents, ws.data.dataset_hash, layer_ids, ws.data.config.max_length, e2e_workdir
        )
    assert hit and forward.call_count == 0
    features, final = cache.document(0)
    assert features.shape == (len(documents[0].input_ids), len(layer_ids) * 576) and final.shape[1] == 576

    # Corrupt a copy: other tests (and another pytest-xdist worker) read the shared cache meanwhile.
    copy = tmp_path / "features" / cache.directory.name
    shutil.copytree(cache.directory, copy)
    shard = copy / cache.manifest["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-100] + bytes(100))
    with pytest.raises(CorruptFeatureCache, match="corrupt"):
        load_or_build(
            ws.target,
            documents,
            ws.data.dataset_hash,
            layer_ids,
            ws.data.config.max_length,
            tmp_path,
            on_corrupt="error",
        )


def _run(workdir, name):
    client = mlflow.MlflowClient(tracking.tracking_uri(workdir))
    runs = client.search_runs(
        [client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT).experiment_id], f"attributes.run_name = '{name}'"
    )
    assert len(runs) == 1
    return client, runs[0]


def test_mlflow_records_documented_params_and_metrics(e2e_workspace, e2e_workdir):
    config = e2e_run_config("dflash2")
    result = train(config, e2e_workspace, run_name="names-check")
    client, run = _run(e2e_workdir, "names-check")
    params = run.data.params
    for name in (
        "algorithm",
        "shared.block_size",
        "shared.target_layer_ids",
        "shared.loss",
        "shared.position_weighting",
        "algo.conv_kernel_size",
        "algo.selector_rank",
        "shared.candidate_top_k",
        "algo.selector_loss_alpha",
        "train.learning_rate",
        "train.seed",
        "target",
        "target_hash",
        "dataset",
        "dataset_hash",
        "data.decontaminate",
    ):
        assert name in params, name
    assert params["shared.mask_token_id"] == "16" and params["target"] == "smollm2-135m"
    # chitchat shares no run of 10 words with MT-bench: the count is logged, and it is 0
    assert params["decontaminated_conversations"] == "0" and params["data.decontaminate"] == "True"
    metrics = run.data.metrics
    for name in (
        "accept/unary",
        "accept/realized",
        "accept/oracle",
        "se/accept/realized",
        "val/num_anchors",
        "val/unary_candidate_recall",
        "val/unary_candidate_target_mass",
        "val/teacher_forced_selector_acc",
        "val/realized_position_1_conditional_acc",
        "val/oracle_position_7_conditional_acc",
        "train/loss",
        "train/unary_loss",
        "train/selector_loss",
        "train/lr",
        "train/draft_tokens_per_s",
        "train/target_feature_tokens_per_s",
    ):
        assert name in metrics, name
    assert metrics["accept/realized"] == pytest.approx(result.validation["realized_accepted_length"])
    assert run.data.tags[tracking.TAG_ALGORITHM] == "dflash2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "per_position.csv", "validation_documents.csv", "per_position.png"} <= artifacts
    history = client.get_metric_history(run.info.run_id, "accept/realized")
    assert [m.step for m in history] == [0, 2, 4]


def test_nan_loss_stops_the_run_cleanly(e2e_workspace, e2e_workdir):
    from algorithms.dflash import DFlashDraft

    config = e2e_run_config("dflash", max_steps=6, checkpoint_every=1)
    real = DFlashDraft.training_forward
    calls = {"n": 0}

    def poisoned(self, row, anchors):
        out = real(self, row, anchors)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                out.loss = out.loss * float("nan")
        return out

    with (
        mock.patch.object(DFlashDraft, "training_forward", poisoned),
        pytest.raises(NonFiniteLoss, match="non-finite loss nan at step 3"),
    ):
        train(config, e2e_workspace, run_name="nan-check")
    _, run = _run(e2e_workdir, "nan-check")
    assert run.info.status == "FAILED"
    assert "non-finite loss" in run.data.tags[tracking.TAG_STATUS_REASON]
    state = torch.load(e2e_workdir / "runs" / "nan-check" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in state["model"].values())


def _cli_train(workdir, run_name: str, *flags: str) -> list[str]:
    """`dflash-lab train` at the end-to-end sizes (conftest.e2e_run_config), as a subprocess command."""
    config_path = workdir / f"{run_name}.yaml"
    config_path.write_text("data: {max_new_tokens: 48, max_length: 192}\n")
    sizes = ["--num-conversations", "40", "--num-validation", "8", "--row-length", "512", "--max-anchors", "8"]
    return [
        *(sys.executable, "-m", "harness.cli", "train", "--workdir", str(workdir), "--run-name", run_name),
        *sizes,
        *("--config", str(config_path)),
        *flags,
    ]


def _kill_once_written(args: list[str], path) -> None:
    """Run `args` and kill -9 it as soon as `path` exists."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not path.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    process.kill()
    process.wait()


def test_resume_after_kill_continues_the_same_run(e2e_workspace, e2e_workdir):
    args = _cli_train(
        e2e_workdir,
        "resume-check",
        "--algorithm",
        "dflash2",
        "--max-steps",
        "8",
        "--eval-every",
        "2",
        "--checkpoint-every",
        "2",
        "--log-every",
        "1",
    )
    checkpoint = e2e_workdir / "runs" / "resume-check" / "checkpoint.pt"
    _kill_once_written(args, checkpoint)
    killed_at = torch.load(checkpoint, weights_only=False)["step"]
    assert 2 <= killed_at < 8, "the run must be killed mid-way"
    _, run = _run(e2e_workdir, "resume-check")
    first_run_id = run.info.run_id

    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    client, run = _run(e2e_workdir, "resume-check")
    assert run.info.run_id == first_run_id and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "accept/realized")]
    assert steps[-1] == 8 and killed_at in steps and sorted(set(steps)) == steps
    assert torch.load(checkpoint, weights_only=False)["step"] == 8
    assert f"resuming resume-check at step {killed_at}" in done.stderr
    changed = subprocess.run([*args, "--resume", "--max-steps", "9"], capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert (
        "invalid --resume of 'resume-check': train.max_steps=9, but its checkpoint was trained with 8"
        in (changed.stderr.strip().splitlines()[-1])
    )


def test_a_run_killed_before_its_first_checkpoint_resumes_in_the_same_mlflow_run(e2e_workspace, e2e_workdir):
    args = _cli_train(
        e2e_workdir,
        "early-kill",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--checkpoint-every",
        "4",
        "--log-every",
        "1",
    )
    run_file = e2e_workdir / "runs" / "early-kill" / "run.json"
    _kill_once_written(args, run_file)
    assert run_file.exists() and not (e2e_workdir / "runs" / "early-kill" / "checkpoint.pt").exists()
    _, run = _run(e2e_workdir, "early-kill")
    first_run_id = run.info.run_id

    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    client, run = _run(e2e_workdir, "early-kill")
    assert run.info.run_id == first_run_id and run.info.status == "FINISHED"
    for key in ("accept/realized", "train/loss"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), f"{key} logged a step twice: {steps}"
    assert run.data.tags[tracking.TAG_STATUS] == "finished"

    # Its checkpoint deleted, run.json kept: a resume would restart at step 0 into the same MLflow run.
    (e2e_workdir / "runs" / "early-kill" / "checkpoint.pt").unlink()
    rows = len(client.get_metric_history(run.info.run_id, "train/loss"))
    refused = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "checkpoint.pt is missing but its MLflow run already holds metrics" in refused.stderr.splitlines()[-1]
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == rows


def test_online_features_equal_the_cache(e2e_workspace, e2e_workdir):
    """`--features online`: the target computes the features inside the step; same loss, nothing on disk."""
    import dataclasses

    from harness.run import Run
    from harness.train import TrainingRecipe, prepare_workspace, with_target_defaults

    cached_config = with_target_defaults(e2e_run_config("dflash2"), e2e_workspace.target)
    online_config = dataclasses.replace(
        cached_config, train=dataclasses.replace(cached_config.train, features="online")
    )
    before = sorted((e2e_workdir / "features").rglob("*"))
    online = prepare_workspace(online_config, e2e_workdir)
    assert all(row.features.numel() == 0 for row in online.train_rows), "training rows wait for their step"
    row, cached_row = online.training_row(0), e2e_workspace.training_row(0)
    assert row.features.dtype == cached_row.features.dtype == torch.bfloat16
    assert torch.allclose(row.features.float(), cached_row.features.float(), rtol=2e-2, atol=2e-2)
    losses = [
        float(TrainingRecipe(config, workspace, Run(e2e_workdir, f"online-{name}")).step(0).loss.detach())
        for name, config, workspace in (("cached", cached_config, e2e_workspace), ("online", online_config, online))
    ]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert sorted((e2e_workdir / "features").rglob("*")) == before, "online mode writes no cache"


def test_sigterm_records_the_run_interrupted_and_resume_continues_it(e2e_workspace, e2e_workdir):
    """Preemption: SIGTERM mid-run ends `train` in one line with exit 143, the run is recorded interrupted with
    the reason, and `--resume` continues it in the same MLflow run without logging a step twice."""
    import signal

    args = _cli_train(e2e_workdir, "preempted", "--max-steps", "8", "--eval-every", "4", "--checkpoint-every", "2")
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint = e2e_workdir / "runs" / "preempted" / "checkpoint.pt"
    deadline = time.time() + 300
    while not checkpoint.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)") and "Traceback" not in stderr
    client, run = _run(e2e_workdir, "preempted")
    assert run.data.tags[tracking.TAG_STATUS] == "interrupted"
    assert "SIGTERM" in run.data.tags[tracking.TAG_STATUS_REASON]
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    client, resumed = _run(e2e_workdir, "preempted")
    assert resumed.info.run_id == run.info.run_id and resumed.data.tags[tracking.TAG_STATUS] == "finished"
    # train.precision `auto`: what it chose on this CPU is recorded, since seeded runs repeat only where it agrees
    assert resumed.data.tags[tracking.TAG_COMPUTES_IN] == computes_in("cpu", "auto")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 8


def _private_tmpfs_works() -> bool:
    """A tmpfs can be mounted in a private user + mount namespace (no privileges needed where allowed)."""
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d && rmdir $d"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe], capture_output=True)
    return done.returncode == 0


def test_a_full_disk_fails_the_run_in_one_line_and_resume_continues_once_space_is_freed(
    e2e_workspace, e2e_workdir, tmp_path
):
    """The work directory on a tmpfs with room for one checkpoint and a half: the second save fills it. The run
    ends in one line, recorded failed with the reason (SQLite on the same full filesystem can still write it,
    since the failed temporary is closed and gone), the first checkpoint stays loadable; after the tmpfs grows,
    `--resume` finishes the run in the same MLflow run without a step logged twice."""
    import yaml

    from harness.cli import planned_draft

    if not _private_tmpfs_works():
        pytest.skip("this machine allows no private tmpfs mount (unshare --user --mount)")
    run_config = e2e_run_config("dflash", max_steps=4, eval_every=2, checkpoint_every=2)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config.to_dict()))
    parameters = sum(p.numel() for p in planned_draft(run_config, e2e_workdir).parameters())
    checkpoint_bytes = 12 * parameters  # fp32 weights and AdamW's two moments
    mount, out = tmp_path / "full", tmp_path / "out"
    mount.mkdir()
    out.mkdir()
    train = f"{sys.executable} -m harness.cli train --config {config} --run-name full --workdir {mount}"
    links = " && ".join(f"ln -s {e2e_workdir / cache} {mount / cache}" for cache in ("targets", "data", "features"))
    script = f"""
        mount -t tmpfs -o size={int(1.5 * checkpoint_bytes) + 16 * 2**20} tmpfs {mount} && {links}
        {train} > /dev/null 2> {out}/first.err; echo $? > {out}/first.rc
        cp -a {mount}/. {out}/failed
        mount -o remount,size={4 * checkpoint_bytes + 64 * 2**20} {mount}
        {train} --resume > /dev/null 2> {out}/second.err; echo $? > {out}/second.rc
        cp -a {mount}/. {out}/final
    """
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], timeout=900, check=True)
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "2", first_err[-3000:]
    assert "Traceback" not in first_err
    last = first_err.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "could not be written" in last and "--resume" in last, last
    failed = out / "failed"
    client, run = _run(failed, "full")
    assert run.info.status == "FAILED" and run.data.tags[tracking.TAG_STATUS] == "failed"
    assert "could not be written" in run.data.tags[tracking.TAG_STATUS_REASON]
    assert torch.load(failed / "runs" / "full" / "checkpoint.pt", weights_only=False)["step"] == 2
    assert not list((failed / "runs" / "full").glob("*.tmp*")), "the failed temporary is removed"
    second_err = (out / "second.err").read_text()
    assert (out / "second.rc").read_text().strip() == "0", second_err[-3000:]
    client, resumed = _run(out / "final", "full")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 4


def test_validation_documents_without_anchors_are_refused_before_a_run_starts(e2e_workspace, tmp_path):
    """All-empty assistant turns leave no anchor to validate on: one clear error, and no run is created."""
    import dataclasses

    silent = [
        dataclasses.replace(d, loss_mask=torch.zeros_like(d.loss_mask)) for d in e2e_workspace.validation_documents
    ]
    workspace = dataclasses.replace(e2e_workspace, workdir=tmp_path, validation_documents=silent)
    with pytest.raises(ValueError, match=r"^invalid --data='chitchat': no validation anchors \(no assistant token"):
        train(e2e_run_config("dflash"), workspace, run_name="no-anchors")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_tracking_server_that_dies_for_good_ends_the_run_in_one_line_after_a_bounded_wait(
    e2e_workspace, e2e_workdir, tmp_path
):
    """A real `mlflow server`, SIGKILLed after the run's first checkpoint: the next call retries for the bounded
    time (shortened here through MLflow's own variables, which dflash-lab only defaults), then `train` stops in
    one line and run.json records the ending the server never got."""
    import json
    import re
    import signal

    server_options = ("--artifacts-destination", str(tmp_path / "server-artifacts"))
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", *server_options) as (url, server):
        deadline = time.time() + 300
        workdir = tmp_path / "work"
        link_caches(workdir, e2e_workdir)
        args = _cli_train(workdir, "server-lost", "--max-steps", "8", "--checkpoint-every", "2", "--eval-every", "8")
        env = {**os.environ, "MLFLOW_TRACKING_URI": url, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        checkpoint = workdir / "runs" / "server-lost" / "checkpoint.pt"
        while not checkpoint.exists() and time.time() < deadline and process.poll() is None:
            time.sleep(0.1)
        os.killpg(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = process.communicate(timeout=300)
        waited = time.monotonic() - killed
    assert process.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    said = re.findall(r"error:.*", stderr)
    assert len(said) == 1 and said[0].startswith(f"error: the MLflow server at {url} stopped answering"), said
    assert waited < 120, f"{waited:.0f} s after the server died"  # 2 retries: 2 + 4 s of backoff per call
    record = json.loads((workdir / "runs" / "server-lost" / "run.json").read_text())
    assert record["unrecorded"]["status"] == "failed" and "MlflowException" in record["unrecorded"]["reason"]


def test_two_trainings_of_one_run_name_at_the_same_moment_leave_one_run(e2e_workspace, e2e_workdir, tmp_path):
    """Both start on a fresh work directory; one holds the run (a lock on its directory) and trains it, the
    other refuses in one line. The store ends with one MLflow run of that name."""
    import re

    link_caches(tmp_path, e2e_workdir)
    args = _cli_train(tmp_path, "contested", "--max-steps", "4")
    processes = [subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    outcomes = sorted(((p.wait(timeout=600), p.stderr.read()) for p in processes), key=lambda pair: pair[0])
    (won, _), (lost, stderr) = outcomes
    assert (won, lost) == (0, 2), [err[-2000:] for _, err in outcomes]
    said = re.findall(r"error:.*", stderr)
    assert len(said) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert "is being trained by another process right now" in said[0] or "already holds a run" in said[0], said
    _run(tmp_path, "contested")  # exactly one MLflow run of that name


def test_ctrl_c_ends_with_one_line_and_exit_130(e2e_workspace, e2e_workdir, tmp_path):
    """Ctrl-C while `prepare` regenerates the data (a Python loop, so the interrupt lands within a batch), in a
    work directory that shares only the end-to-end tests' converted target (so the data is regenerated).

    The command starts with SIGINT at its default: a test run started in the background of a script inherits
    SIGINT ignored (as shells start background jobs), and Python then never turns it into KeyboardInterrupt."""
    import signal
    import threading

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "targets").symlink_to((e2e_workdir / "targets").resolve())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "prepare", "--workdir", str(tmp_path / "work")],
        cwd=Path(__file__).parent.parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    chunks, regenerating = [], threading.Event()

    def read() -> None:
        # os.read returns what the pipe holds; a buffered read(n) would wait for n bytes, which tqdm's
        # progress bar only reaches when the first generation batch ends, long after the line appeared
        while chunk := os.read(process.stderr.fileno(), 4096).decode(errors="replace"):
            chunks.append(chunk)
            if "regenerating responses" in "".join(chunks[-2:]):
                regenerating.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert regenerating.wait(timeout=600), "".join(chunks)[-2000:]
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=30)
    stderr = "".join(chunks)
    assert process.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C)") and "Traceback" not in stderr
    leftovers = [p.name for p in (tmp_path / "work").rglob("*") if ".tmp" in p.name and "targets" not in p.parts]
    assert leftovers == []


def test_a_wsd_run_and_its_branch_through_the_cli(e2e_workspace, e2e_workdir):
    """`train --schedule wsd --branches 4` keeps its stable checkpoint at step 3; `train --branch-of` anneals it to
    step 4 in a run of its own, whose curve starts at the step it branched from and whose params name its parent."""
    trunk = _cli_train(
        e2e_workdir,
        "wsd-trunk",
        *("--algorithm", "dflash2", "--schedule", "wsd", "--max-steps", "8", "--branches", "4"),
        *("--decay-ratio", "0.25", "--warmup-ratio", "0", "--eval-every", "4", "--checkpoint-every", "4"),
    )
    done = subprocess.run(trunk, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (e2e_workdir / "runs" / "wsd-trunk" / "stable-step3.pt").exists()
    branch = [sys.executable, "-m", "harness.cli", "train", "--workdir", str(e2e_workdir)]
    done = subprocess.run([*branch, "--branch-of", "wsd-trunk", "--max-steps", "4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "branching wsd-trunk-decay4 from wsd-trunk at step 3: decay to 4" in done.stderr
    client, run = _run(e2e_workdir, "wsd-trunk-decay4")
    assert run.info.status == "FINISHED"
    assert run.data.params["train.branch_of"] == "wsd-trunk" and run.data.params["train.schedule"] == "wsd"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accept/realized")] == [3, 4]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/lr")] == [pytest.approx(0.0)]
    # The trained drafter is in MLflow: its export (config and bf16 weights), and the libraries it ran on
    artifacts = {a.path: a.file_size for a in client.list_artifacts(run.info.run_id, "export")}
    exported = e2e_workdir / "runs" / "wsd-trunk-decay4" / "export"
    assert artifacts == {f"export/{f.name}": f.stat().st_size for f in exported.iterdir()}
    assert set(artifacts) == {"export/config.json", "export/model.safetensors"}
    assert run.data.tags["dflash_lab.version.torch"] == torch.__version__
