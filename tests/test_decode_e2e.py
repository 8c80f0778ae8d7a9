"""Speculative decoding on the real embedded target with drafts trained by the harness."""

import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from unittest import mock

import mlflow
import pytest

from harness import tracking
from harness.config import EvalConfig
from harness.decode import speculative_generate, target_greedy
from harness.evaluate import evaluate, prompt_ids
from harness.files import remove
from harness.mtbench import mtbench_questions
from harness.serving import metrics as served_names

from conftest import E2E_MEMBERS, child_running, e2e_run_config, gone, started_server

pytestmark = pytest.mark.slow
# 4 prompts x 64 tokens reach well over a hundred verify cycles and accepted drafts per algorithm in CI; the
# full 20 x 128 check (10 minutes on the 2-core machine) runs with DFLASH_LAB_FULL_LOSSLESS=1.
NUM_PROMPTS, MAX_NEW_TOKENS = (20, 128) if os.environ.get("DFLASH_LAB_FULL_LOSSLESS") else (4, 64)


@pytest.fixture(scope="session")
def mtbench_references(e2e_workspace):
    """The target alone, greedy, on the first NUM_PROMPTS MT-bench questions (computed once)."""
    tokenizer = e2e_workspace.target.tokenizer
    stop = {tokenizer.eos_token_id}
    prompts = [prompt_ids(tokenizer, q) for q in mtbench_questions(NUM_PROMPTS)]
    return prompts, target_greedy(e2e_workspace.target.model, tokenizer, prompts, MAX_NEW_TOKENS, stop)


@pytest.mark.parametrize("algorithm", E2E_MEMBERS)
def test_training_raises_validation_acceptance_above_untrained(trained, algorithm):
    """60 steps lift realized acceptance above the untrained value by more than the final validation's noise.

    Measured on every anchor of the 8 validation documents (233): dflash2 1.000 -> 1.451 [1.08, 1.82], dflash
    1.000 -> 1.030 [1.012, 1.048]; both intervals exclude the untrained 1.0. On the 32-anchor subset the same
    dflash draft read 1.094: the kind of noise the full set and its interval make visible.
    """
    from scipy import stats

    result = trained[algorithm]
    untrained, final = result.history[0], result.history[-1]
    assert untrained["step"] == 0 and final["step"] == 60
    assert untrained["realized_accepted_length"] == pytest.approx(1.0, abs=0.05)
    half = stats.t.ppf(0.975, final["num_documents"] - 1) * final["realized_accepted_length_se"]
    assert final["realized_accepted_length"] - half > untrained["realized_accepted_length"]
    assert final["oracle_accepted_length"] >= final["realized_accepted_length"]
    assert final["loss"] < untrained["loss"] / 2


@pytest.mark.parametrize("algorithm", E2E_MEMBERS)
def test_greedy_speculative_decoding_is_lossless_on_mtbench(e2e_workspace, trained, mtbench_references, algorithm):
    prompts, references = mtbench_references
    draft = trained[algorithm].draft
    stop = {e2e_workspace.target.tokenizer.eos_token_id}
    cycles = 0
    for prompt, reference in zip(prompts, references, strict=True):
        stats = speculative_generate(e2e_workspace.target.model, draft, prompt, MAX_NEW_TOKENS, stop)
        assert stats.tokens == reference
        cycles += len(stats.acceptance_lengths)
        assert (
            sum(stats.acceptance_lengths) == len(stats.tokens) - 1
        )  # tau counts every committed token after the prefill's
    assert cycles < sum(len(r) for r in references), "some drafts were accepted"


def test_evaluate_logs_measured_acceptance_into_the_run(e2e_workspace, e2e_workdir, trained):
    run_id = trained["dflash2"].run_id
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "evaluate",
            "learns-dflash2",
            "--workdir",
            str(e2e_workdir),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "24",
            "--temperatures",
            "0",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir)).get_run(run_id).data.metrics
    for name in (
        "measured_accepted_length_greedy",
        "measured_accepted_length_t1",
        "measured_accepted_length_greedy_position_1_conditional_acc",
        "measured_accepted_length_greedy_draft_time_share",
        "measured_accepted_length_greedy_tokens_per_s",
        "chat_offline_realized_accepted_length",
        "chat_offline_realized_accepted_length_replayed",
        "chat_measured_minus_offline",
        "mtbench_offline_realized_accepted_length",
        "mtbench_offline_realized_accepted_length_replayed",
        "mtbench_measured_minus_offline",
    ):
        assert f"eval/{name}" in metrics, name
    assert metrics["eval/mtbench_lossless_fraction"] == 1.0 and metrics["eval/chat_lossless_fraction"] == 1.0
    assert metrics["eval/measured_accepted_length_greedy"] >= 1.0
    # decoding cycles replayed offline on the target's own continuations agree with measured greedy decoding
    for name in ("chat", "mtbench"):
        measured, replayed = (
            metrics[f"eval/{name}_measured_accepted_length_greedy_pooled"],
            metrics[f"eval/{name}_offline_realized_accepted_length_replayed"],
        )
        assert abs(measured - replayed) / replayed <= 0.10, name
    records = json.loads((e2e_workdir / "runs" / "learns-dflash2" / "eval_records.json").read_text())
    assert {r["set"] for r in records} == {"mtbench", "chat"} and all(
        r["lossless"] for r in records if r["temperature"] == 0
    )
    # requests are the independent units of a measured accepted length: its standard error is theirs
    greedy = [r["mean_acceptance_length"] for r in records if r["temperature"] == 0 and r["cycles"]]
    assert metrics["se/eval/measured_accepted_length_greedy"] == pytest.approx(
        statistics.stdev(greedy) / len(greedy) ** 0.5, rel=1e-6
    )


def test_evaluate_decodes_a_users_own_prompts_in_mtbench_place(e2e_workspace, trained, tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "Name three colours."}\n\n{"prompt": "Say hello to Ada."}\n{"prompt": "unused"}\n')
    config = EvalConfig(num_prompts=2, max_new_tokens=12, temperatures=(0.0,), prompts=str(mine))
    workspace = e2e_workspace
    metrics, records = evaluate(workspace.target, trained["dflash2"].draft, workspace.data.validation, config)
    assert [(r["set"], r["prompt"]) for r in records] == [("prompts", 0), ("prompts", 1), ("chat", 0), ("chat", 1)]
    assert all(r["lossless"] for r in records) and records[0]["tokens"] == 12
    assert metrics["prompts_measured_accepted_length_greedy"] >= 1.0 and not any("mtbench" in m for m in metrics)


@pytest.mark.peer
@pytest.mark.parametrize("algorithm", ["dflash2", "dflash"])
def test_zlab_spec_generate_matches_our_loop(e2e_workspace, trained, tmp_path, algorithm):
    """Our exported checkpoint in Z Lab's dflash 0.1.0 spec_generate: same tokens, same per-cycle acceptance."""
    import torch

    zlab = pytest.importorskip(
        "dflash.model", reason="dflash==0.1.0 (Z Lab reference) is not installed; .ci/run installs it with --no-deps"
    )
    from harness.export import export_checkpoint, load_exported_weights

    draft = trained[algorithm].draft
    out = export_checkpoint(draft, tmp_path / "ckpt", e2e_workspace.target.source)
    load_exported_weights(draft, out)  # ours runs the same bf16-rounded weights
    cls = zlab.DFlash2DraftModel if algorithm == "dflash2" else zlab.DFlashDraftModel
    theirs = cls.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer, model = e2e_workspace.target.tokenizer, e2e_workspace.target.model
    stop = tokenizer.eos_token_id
    for prompt in [prompt_ids(tokenizer, q) for q in mtbench_questions(2)]:
        ours = speculative_generate(model, draft, prompt, 32, {stop})
        # their stats timer synchronises CUDA; on a CPU-only torch it must be a plain clock
        with torch.no_grad(), mock.patch.object(zlab, "_cuda_time", time.perf_counter):
            reference = zlab.dflash_generate(
                theirs.eval(), model, torch.tensor([prompt]), 32, [stop], temperature=0.0, return_stats=True
            )
        assert reference.output_ids[0, len(prompt) :].tolist() == ours.tokens
        assert reference.acceptance_lengths == ours.acceptance_lengths


@pytest.mark.peer
def test_export_loads_in_speculators_from_another_working_directory(e2e_workspace, e2e_workdir, trained, tmp_path):
    """The export names its verifier by an absolute path, so vLLM's loader works from any directory."""
    pytest.importorskip("speculators", reason="speculators==0.9.0 is not installed (.ci/run installs it)")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "exported"
    export = [sys.executable, "-m", "harness.cli", "export", "learns-dflash2", "--workdir", str(e2e_workdir)]
    done = subprocess.run([*export, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier.startswith("/")
    load = (
        "import sys; from speculators.models.dflash2 import DFlash2DraftModel; "
        "DFlash2DraftModel.from_pretrained(sys.argv[1])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(out)], cwd=elsewhere, capture_output=True, text=True, timeout=600
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    (out / "notes.txt").write_text("a user's file")
    refused = subprocess.run([*export, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "pass --force to replace it" in refused.stderr
    assert (out / "notes.txt").exists()


@pytest.fixture(scope="module")
def served_runs(e2e_workspace, trained):
    """The 60-step DFlash2 run, and a short DSpark run (served as llama.cpp's draft-dspark)."""
    from harness.train import train

    dspark = train(
        e2e_run_config("dspark", max_steps=20, eval_every=20, checkpoint_every=20, log_every=10),
        e2e_workspace,
        run_name="serves-dspark",
    )
    return {"dflash2": trained["dflash2"], "dspark": dspark}


@pytest.mark.parametrize("algorithm", ["dflash2", "dspark"])
def test_llama_cpp_serves_the_run_and_agrees_with_the_harness_cycle_by_cycle(
    e2e_workspace, e2e_workdir, served_runs, algorithm
):
    """The real engine (built by scripts/setup.sh), the real conversion and server: every compared cycle accepts
    what the harness's decoder accepts, unless a counted near-tie of the target explains it; the lossless counts
    match the records; the GGUF carries the draft's shape."""
    from harness.config import EvalConfig
    from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, Run
    from harness.serving.compare import log_served, serve_and_compare
    from harness.serving.engine import find_engine

    engine = find_engine()
    result = served_runs[algorithm]
    run = Run.at(result.run_dir)
    draft = result.draft
    # T = 1 through the engine once (DFlash2): its sampled path is the same for every draft type
    sampled = algorithm == "dflash2"
    config = EvalConfig(num_prompts=2, max_new_tokens=32, temperatures=(0.0, 1.0) if sampled else (0.0,))
    metrics, records = serve_and_compare(
        engine, run, e2e_workspace.target, draft, e2e_workspace.data.validation, config
    )
    assert metrics["cycles_compared"] >= 10 and len(records) == 4, records
    for record in records:
        if record["divergence"] is not None:
            assert "near-tie" in record["divergence"]["cause"], record  # a token flip at a near-tie
            assert "not a near-tie" not in record["divergence"]["cause"], record
    unexplained = [r for r in records if r["divergence"] and "near-tie" not in r["divergence"]["cause"]]
    assert not unexplained
    assert metrics["lossless_flips_vs_engine"] == sum(r["served_tokens_differ_from_engine_alone"] for r in records)
    assert metrics["lossless_flips_vs_harness"] == sum(
        r["served_tokens_differ_from_harness_reference"] for r in records
    )
    assert all("near-tie" in r["flip"] and "not a near-tie" not in r["flip"] for r in records if "flip" in r)
    assert metrics["tokens_per_s_draft"] > 0 and metrics["tokens_per_s_alone"] > 0
    # A verify cycle of a whole block costs more than one plain decoding step on the CPU, so the break-even lies
    # above 1, and the run's shortfall is measured against it.
    assert metrics["cycle_cost_plain_tokens"] > 1 and metrics["break_even_accepted_length"] > 1
    assert metrics["break_even_accepted_length_low"] <= metrics["break_even_accepted_length"]
    assert metrics["break_even_shortfall"] == pytest.approx(
        metrics["break_even_accepted_length"] - metrics["accepted_length_greedy"]
    )
    assert 1.0 <= metrics["accepted_length_greedy"] <= draft.block_size
    if sampled:
        assert 1.0 <= metrics["accepted_length_t1"] <= draft.block_size  # served at T = 1 ...
        assert 1.0 <= metrics["harness_accepted_length_t1"] <= draft.block_size  # ... beside the harness at T = 1
    else:
        assert "accepted_length_t1" not in metrics and "harness_accepted_length_t1" not in metrics
    # the per-cycle trace lines add up to the server's own per-request totals
    assert sum(r["served_draft_n_accepted"] for r in records) == sum(sum(r["served_accepted"]) for r in records)
    assert sum(r["served_draft_n"] for r in records) == sum(sum(r["served_drafted"]) for r in records)

    log_served(run, engine, metrics, records)
    logged = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir)).get_run(run.run_id).data
    assert logged.metrics["served/llama_cpp/agreement_cycle_fraction"] == metrics["agreement_cycle_fraction"]
    assert logged.tags[tracking.TAG_ENGINE_COMMIT] == engine.commit
    artifacts = {
        a.path: a.file_size for a in mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir)).list_artifacts(run.run_id)
    }
    served_draft = run.path(SERVED_DIR) / DRAFT_GGUF_FILE
    assert artifacts[DRAFT_GGUF_FILE] == served_draft.stat().st_size  # the draft as served, where users look

    sys.path.insert(0, str(engine.gguf_py))  # the tree's own reader of what its converter wrote
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    fields = GGUFReader(served_draft).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    assert value("general.architecture") == "dflash"
    assert value("dflash.block_size") == draft.block_size
    assert value("dflash.target_layers") == list(draft.config.target_layer_ids)
    assert value("tokenizer.ggml.mask_token_id") == draft.config.mask_token_id
    assert value("dflash.attention.causal") is draft.config.causal_blocks
    if algorithm == "dflash2":
        assert value("dflash.conv_kernel_size") == draft.config.conv_kernel_size
        assert value("dflash.conv_group_size") == draft.config.conv_group_size
        assert value("dflash.selector_rank") == draft.knobs.selector_rank
        assert value("dflash.selector_top_k") == draft.shared.candidate_top_k
    else:  # DSpark: its Markov head (and confidence head) travel as tensors
        assert value("dflash.sample_from_anchor") is draft.shared.sample_from_anchor
        assert value("dflash.has_confidence_head") is True


CLI = [sys.executable, "-m", "harness.cli"]
# One prompt per set and few tokens: these tests are about stopping, not about the numbers.
QUICK_EVALUATION = ["--num-prompts", "1", "--temperatures", "0"]


@pytest.mark.parametrize(
    "command",
    [["serve", "serves-dspark"], ["evaluate", "serves-dspark", "--engine", "llama.cpp", *QUICK_EVALUATION]],
    ids=["serve", "evaluate"],
)
def test_a_sigkilled_command_leaves_no_llama_server(e2e_workdir, served_runs, spawn, command):
    """SIGKILL gives the process no chance to stop its server: the kernel's parent-death signal does."""
    process = spawn([*CLI, *command, "--workdir", str(e2e_workdir)], stdout=subprocess.DEVNULL)
    server = started_server(e2e_workdir, process)
    process.kill()
    process.wait()
    assert gone(server["pid"]), "llama-server outlived the dflash-lab process that started it"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=2)


def test_sigterm_mid_request_records_the_serving_interrupted_and_a_rerun_logs_each_metric_once(
    e2e_workdir, served_runs, spawn
):
    from harness.run import SERVED_DIR, Run

    run = Run.at(served_runs["dspark"].run_dir)
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    metric = f"{served_names.PREFIX}agreement_cycle_fraction"
    rows = lambda: len(client.get_metric_history(run.run_id, metric))  # noqa: E731
    before = rows()
    evaluate = [*CLI, "evaluate", run.name, "--engine", "llama.cpp", "--workdir", str(e2e_workdir)]
    process = spawn(
        [*evaluate, *QUICK_EVALUATION, "--max-new-tokens", "96"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    server = started_server(e2e_workdir, process, log=run.path(SERVED_DIR) / "server-draft.log")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr.decode(), stderr.decode()[-3000:]
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("error: terminated (SIGTERM); finished work is kept; run the same command again: ")
    assert f"dflash-lab evaluate {run.name} --engine llama.cpp --workdir {e2e_workdir}" in last, last
    assert gone(server["pid"])
    tags = client.get_run(run.run_id).data.tags
    assert tags[tracking.TAG_SERVED_STATUS] == "interrupted" and "SIGTERM" in tags[tracking.TAG_SERVED_REASON]
    assert rows() == before, "an interrupted serving logs no served/* metric"

    done = subprocess.run([*evaluate, *QUICK_EVALUATION, "--max-new-tokens", "16"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert client.get_run(run.run_id).data.tags[tracking.TAG_SERVED_STATUS] == "finished"
    assert rows() == before + 1, "the rerun logs each served metric once"
    assert not list((e2e_workdir / "served" / "servers").glob("*.json")), "no server is left recorded"


def test_a_sigterm_to_serve_names_the_command_to_run_again(e2e_workdir, served_runs, spawn):
    process = spawn(
        [*CLI, "serve", "serves-dspark", "--workdir", str(e2e_workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server = started_server(e2e_workdir, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr.decode(), stderr.decode()[-3000:]
    assert stderr.decode().strip().splitlines()[-1] == (
        "error: terminated (SIGTERM); finished work is kept; run the same command again: "
        f"dflash-lab serve serves-dspark --workdir {e2e_workdir}"
    )
    assert gone(server["pid"])


def test_a_sigkill_during_the_drafts_conversion_leaves_no_converter_and_the_next_conversion_no_temporary(
    e2e_workspace, e2e_workdir, served_runs
):
    from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, Run
    from harness.serving.draft import draft_gguf
    from harness.serving.engine import find_engine
    from harness.serving.gguf import STAMP_SUFFIX

    run = Run.at(served_runs["dspark"].run_dir)
    served = run.path(SERVED_DIR)
    for name in (DRAFT_GGUF_FILE, DRAFT_GGUF_FILE + STAMP_SUFFIX):  # so that the evaluation converts the draft
        (served / name).unlink(missing_ok=True)
    process = subprocess.Popen(
        [*CLI, "evaluate", run.name, "--engine", "llama.cpp", "--workdir", str(e2e_workdir), *QUICK_EVALUATION],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        converter = child_running(process.pid, DRAFT_GGUF_FILE)
        time.sleep(1)  # into the conversion: the converter has loaded and begun writing its temporary
    finally:
        process.kill()
        process.wait()
    assert gone(converter.pid, within_s=2), "the converter outlived the evaluation that started it"
    draft_gguf(find_engine(), run, served_runs["dspark"].draft, e2e_workspace.target)
    assert not [p.name for p in served.iterdir() if ".tmp" in p.name or ".old" in p.name]


def test_a_sigkilled_export_leaves_nothing_after_the_next_export(e2e_workdir, served_runs, tmp_path):
    """SIGKILL while the export is written (its temporary folder beside --out exists), then a whole export: no
    temporary is left beside it."""
    out = tmp_path / "exported"
    export = [*CLI, "export", "serves-dspark", "--workdir", str(e2e_workdir), "--out", str(out)]
    for _ in range(3):  # the write lasts a fraction of a second: caught while it is under way, or tried again
        process = subprocess.Popen(export, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        temporary = tmp_path / f"exported.tmp{process.pid}"
        while process.poll() is None and not temporary.exists():
            time.sleep(0.001)
        process.kill()
        process.wait()
        if temporary.exists():
            break
        remove(out)
    assert temporary.exists(), "the export was never caught mid-write"
    done = subprocess.run(export, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("exported")) == ["exported"]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_a_prompt_longer_than_the_context_is_refused_before_any_server_starts(
    cli, e2e_workdir, served_runs, tmp_path, monkeypatch
):
    from harness.serving.server import CONTEXT, LlamaServer

    def never(self):
        raise AssertionError("a server started")

    monkeypatch.setattr(LlamaServer, "__enter__", never)
    mine = tmp_path / "long.jsonl"
    mine.write_text('{"prompt": "Name three colours."}\n' + json.dumps({"prompt": "word " * (CONTEXT + 100)}) + "\n")
    result = cli(
        ["evaluate", "serves-dspark", "--engine", "llama.cpp", "--workdir", str(e2e_workdir), "--prompts", str(mine)]
        + ["--num-prompts", "2", "--temperatures", "0", "--max-new-tokens", "16"]
    )
    # the target loads first (its tokenizer counts the tokens; its loading bar is on stderr): then one line
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: invalid prompt 1 of set 'prompts': (\d+) tokens, which with 16 new tokens exceed the "
        rf"server's {CONTEXT}-token context; allowed prompts of at most {CONTEXT - 16} tokens \(.*\)",
        line,
    ), line
    assert int(re.search(r": (\d+) tokens", line).group(1)) > CONTEXT


def test_regeneration_through_llama_server_matches_hf_greedy_except_at_near_ties_and_resumes(
    e2e_workspace, e2e_workdir, tmp_path
):
    """`regenerate_with: llama.cpp`: three slots decode at once; at T = 0 every reply is the target's greedy one
    (transformers, unpadded) unless a counted near-tie of the target flipped a token; a turn the journal already
    holds (a regeneration killed after it) is not requested again; a prompt too long for its document to hold a
    reply (and for a slot to hold it) is not sent, and its document is the one any reply would have made."""
    from harness.data import DataConfig, load_conversations, tokenize_conversation
    from harness.regeneration import Journal, regenerate, template_ids
    from harness.serving.compare import cause_of

    target, tokenizer = e2e_workspace.target, e2e_workspace.target.tokenizer
    config = DataConfig(
        num_conversations=7, num_validation=1, max_new_tokens=24, regenerate_with="llama.cpp", generation_batch_size=3
    )
    long = [{"role": "user", "content": "Tell me about the sea. " * 120}]  # about 720 tokens: over max_length 256
    conversations = [*load_conversations(config, e2e_workdir)[0], long]
    journal = Journal(tmp_path / "journal.jsonl")
    journal.add(0, 0, "a reply from before the kill")
    dialogues = regenerate(target, conversations, config, Journal(journal.path), e2e_workdir)
    assert dialogues[0][1]["content"] == "a reply from before the kill"
    log = (e2e_workdir / "served" / "regeneration.log").read_text()
    assert log.count("launch_slot_") == 6 and "n_slots = 3" in log, "six requests, on three slots"
    assert dialogues[-1][1]["content"] == "" and "exceeds the available context" not in log
    answered = [*long, {"role": "assistant", "content": "Any reply at all."}]
    assert tokenize_conversation(tokenizer, dialogues[-1], 256) == tokenize_conversation(tokenizer, answered, 256)
    prompts = [template_ids(tokenizer, d[:1], add_generation_prompt=True) for d in dialogues[1:-1]]
    references = target_greedy(target.model, tokenizer, prompts, 24, {tokenizer.eos_token_id})
    flips = []
    for prompt, reference, dialogue in zip(prompts, references, dialogues[1:-1], strict=True):
        if dialogue[1]["content"] != tokenizer.decode(reference, skip_special_tokens=True).strip():
            served = tokenizer(dialogue[1]["content"], add_special_tokens=False)["input_ids"]
            flips.append(cause_of(target, prompt, reference, served))
    assert all("near-tie" in f and "not a near-tie" not in f for f in flips), flips
    assert len(flips) <= 1, flips


def test_magpie_instructions_are_written_by_the_target_in_llama_server_and_resume_after_a_kill(
    e2e_workspace, e2e_workdir
):
    """The target writes its own instructions after its template's pre-query text: a synthesis SIGKILLed after a
    few have landed resumes from its journal without sampling them again, and a repeated one samples nothing."""
    from harness.serving.magpie import OPENINGS, pre_query_ids, synthesize

    target, tokenizer = e2e_workspace.target, e2e_workspace.target.tokenizer
    assert tokenizer.decode(pre_query_ids(tokenizer)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
    ), "the default system turn and the user header, nothing of a user's text, no extra BOS"
    seed, count = 7, 12
    code = (
        "import sys; from pathlib import Path; from harness.targets import load_target; "
        "from harness.serving.magpie import synthesize; workdir = Path(sys.argv[1]); "
        f"synthesize(load_target('smollm2-135m', workdir), {count}, {seed}, 2, workdir)"
    )
    process = subprocess.Popen([sys.executable, "-c", code, str(e2e_workdir)], stderr=subprocess.DEVNULL)
    journals = lambda: list((e2e_workdir / "data").glob("magpie-*.jsonl"))  # noqa: E731
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            if journals() and len(journals()[0].read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the synthesis ended before it could be killed"
    finally:
        process.kill()
        process.wait()
    (journal,) = journals()
    try:
        before = [line for line in journal.read_text().splitlines(keepends=True) if line.endswith("\n")]
        instructions, refused = synthesize(target, count, seed, 2, e2e_workdir)
        log = (e2e_workdir / "served" / "magpie.log").read_text()
        after = journal.read_text().splitlines(keepends=True)
        assert after[: len(before)] == before, "what landed before the kill is kept as it was"
        indices = [json.loads(line)["conversation"] for line in after]
        assert len(indices) == len(set(indices)), "no instruction was sampled twice"
        assert log.count("launch_slot_") == len(after) - len(before) < len(after)
        assert len(instructions) == count and refused == 0 and len(set(instructions)) == count
        assert all(any(text.startswith(opening) for opening in OPENINGS.values()) for text in instructions)
        again, _ = synthesize(target, count, seed, 2, e2e_workdir)
        assert again == instructions
        assert (e2e_workdir / "served" / "magpie.log").read_text().count("launch_slot_") == 0
    finally:
        journal.unlink()


def test_magpie_needs_the_target_and_regeneration(tmp_path):
    from harness.data import DataConfig, load_conversations

    for config in (
        DataConfig(dataset="magpie", num_conversations=4, num_validation=1),
        DataConfig(dataset="magpie", num_conversations=4, num_validation=1, regenerate=False),
    ):
        with pytest.raises(ValueError, match=r"invalid --data='magpie': magpie's instructions are written and"):
            load_conversations(config, tmp_path, target=None if config.regenerate else object())


def test_a_draft_over_its_replies_most_frequent_tokens_loads_in_llama_cpp_and_drafts(e2e_workspace, served_runs):
    """The reduced-vocabulary GGUF (its own head over 256 tokens and a d2t map) loads in the pinned engine and
    drafts; the same file without its d2t map does not load (a 256-row head fits only through the map), so the
    engine read the map."""
    from harness.run import SERVED_DIR, Run
    from harness.serving.draft import reduced_draft, served_draft
    from harness.serving.engine import EngineError, find_engine
    from harness.serving.gguf import copy_gguf, target_gguf
    from harness.serving.server import Session

    engine, run = find_engine(), Run.at(served_runs["dflash2"].run_dir)
    target = e2e_workspace.target
    full = served_draft(engine, run, served_runs["dflash2"].draft, target)
    reduced = reduced_draft(engine, run, full, target, e2e_workspace.data.train, 256)
    assert reduced.vocabulary == 256 and reduced.gguf != full.gguf and reduced.shape != full.shape
    session = Session.of(engine, run.workdir, run.path(SERVED_DIR))
    model = target_gguf(engine, run.workdir, target)
    prompt = prompt_ids(target.tokenizer, mtbench_questions(1)[0])
    with session.server(model, "reduced-vocabulary", reduced) as server:
        done = server.complete(prompt, 24, ignore_eos=True)
    assert len(done.tokens) == 24 and done.accepted and all(0 <= a <= reduced.block for a in done.accepted)

    unmapped = reduced.gguf.with_name("draft-no-d2t.gguf")
    copy_gguf(reduced.gguf, unmapped, drop=("d2t",))
    control = dataclasses.replace(reduced, gguf=unmapped)
    with pytest.raises(EngineError), session.server(model, "reduced-vocabulary-no-map", control):
        pass
