"""CPU-side guards for the CUDA paths: one device helper for generators and inputs, fixed shapes where a
device would otherwise stall, dtype-correct decoding, and one pinned device per study worker."""

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import algorithms.unary_head as unary_head
from algorithms import build_draft
from algorithms.dflash import DFlashDraft
from harness import devices
from harness.decode import speculative_generate
from harness.evaluate import offline_realized_on_continuations
from studies import runner

from conftest import (
    anchors_for,
    frozen_tensors,
    packed_row,
    tiny_config,
    tiny_draft,
    tiny_llama,
    tiny_target,
)

ROOT = Path(__file__).parent.parent


def test_every_generator_comes_from_the_device_helper():
    made = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in ("algorithms", "harness", "studies", "reports", "benchmarks")
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"torch\.Generator\(", line) and path != ROOT / "harness" / "devices.py"
    ]
    assert not made, f"generators made outside harness/devices.py: {made}"
    assert devices.generator("cpu", 3).device == torch.device("cpu")
    first, second = (torch.rand(4, generator=devices.generator("cpu", 3)) for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_the_fixed_shape_head_equals_the_compacted_one(algorithm, monkeypatch):
    """CUDA sends every row of a chunk through the head instead of compacting: same loss, gradients, metrics."""
    row = packed_row()
    anchors = anchors_for(row)

    def run():
        draft = tiny_draft(algorithm)
        output = draft.training_forward(row, anchors)
        output.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        return output, grads

    compacted, compacted_grads = run()
    monkeypatch.setattr(unary_head, "COMPACTING_DEVICE_TYPES", ())
    fixed, fixed_grads = run()
    assert float(fixed.loss.detach()) == pytest.approx(float(compacted.loss.detach()), rel=1e-5)
    for name, grad in compacted_grads.items():
        assert torch.allclose(fixed_grads[name], grad, rtol=1e-4, atol=1e-7), name
    for name, pair in compacted.counts.items():
        assert torch.allclose(fixed.counts[name], pair, rtol=1e-6), name


def _greedy(model, prompt: list[int], tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(tokens):
        ids.append(int(model(input_ids=devices.ids_on(ids, devices.model_device(model))).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# The modules by which a member's proposal departs from the unary argmax path, randomised so that it does
SEQUENTIAL_HEADS = ("candidate_selector", "prefix_gru", "embed_proj", "markov_head")
HEAD_STD = 0.3  # their weights: large enough to move proposals, small enough to leave some accepted
LIVE_TOKENS = 4  # the shared head's rows that are not zero: drafts and target agree often enough to accept


def agreeable_pair(algorithm: str):
    """A float64 target and draft that share their embedding and a head with few live rows (the draft reads the
    target's head, as it does in use), so blocks are often partly accepted. The heads that make a member's own
    walk (DFlash2's selector, Domino's GRU and delta, DSpark's Markov term) get weights large enough to move its
    proposals away from the unary path; two of them start at zero, where every member would draft as DFlash."""
    embed, head = frozen_tensors()
    head[LIVE_TOKENS:] = 0
    torch.manual_seed(0)
    # initializer_range: wide enough that the context, not only the last token, moves the next one
    model = tiny_llama(initializer_range=0.2).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    draft = build_draft(tiny_config(algorithm), tiny_target(), embed, head)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if name.startswith(SEQUENTIAL_HEADS):
                parameter.normal_(std=HEAD_STD)
    return model.to(torch.float64), draft.to(torch.float64)


PROMPTS, BUDGET = ([1, 2, 3, 4, 5], [9, 8, 7], [42, 17, 5, 99]), 32


def replay_disagreements(model, draft, greedy: list) -> list[str]:
    """Where the offline replay (teacher-forced `realized`, one block per cycle) accepted other than measured
    decoding did, one line per prompt. The last measured cycle is left out (the token budget ends it and the
    replay knows no budget), as are the cycles after the replay stops, where no whole block fits in what is
    left of the continuation (at most block size - 1 cycles)."""
    offline = offline_realized_on_continuations(
        types.SimpleNamespace(model=model), draft, list(PROMPTS), [run.tokens for run in greedy]
    )
    wrong = []
    for prompt, run, replayed in zip(PROMPTS, greedy, offline.cycles, strict=True):
        decided = len(run.acceptance_lengths) - 1
        compared = min(len(replayed), decided)
        if compared < decided - (draft.block_size - 1) or replayed[:compared] != run.acceptance_lengths[:compared]:
            wrong.append(f"{prompt}: replayed {replayed}, measured {run.acceptance_lengths}")
    return wrong


@pytest.mark.parametrize(
    ("algorithm", "threshold"),
    [("dflash", 0.0), ("dflash2", 0.0), ("jetspec", 0.0), ("domino", 0.0), ("dspark", 0.0), ("dspark", 0.3)],
)
def test_decoding_is_lossless_and_offline_replay_repeats_its_cycles_on_a_non_default_dtype(algorithm, threshold):
    """Target and draft in float64, generators from the helper on the model's device: a tensor built on the
    wrong device or dtype fails here the way it would on CUDA. At T = 0 decoding is the target's greedy
    decoding, and for every member the offline replay accepts exactly what each measured cycle accepted. DSpark
    also decodes confidence-scheduled, which must stay lossless while it verifies fewer tokens."""
    model, draft = agreeable_pair(algorithm)
    with torch.no_grad():
        greedy = [speculative_generate(model, draft, p, BUDGET, set(), 0.0, None, threshold) for p in PROMPTS]
        for prompt, run in zip(PROMPTS, greedy, strict=True):
            assert run.tokens == _greedy(model, prompt, BUDGET), f"lossless at T = 0 on {prompt}"
        sampled = speculative_generate(
            model, draft, PROMPTS[0], BUDGET, set(), 1.0, devices.generator(devices.model_device(model), 0), threshold
        )
    assert len(sampled.tokens) == BUDGET
    lengths = [length for run in greedy for length in run.acceptance_lengths]
    assert max(lengths) > 1, "no draft token was accepted: the replay check would be empty"
    # A whole block per cycle: anchor + every draft slot, fewer where the token budget runs out.
    slots, verified, whole = draft.block_size - draft.shared.first_draft_slot, [], []
    for run in greedy:
        committed = 1
        for length in run.acceptance_lengths:
            whole.append(min(slots, BUDGET - committed) + 1)
            committed += length
        verified += run.verified_tokens
    if threshold > 0:  # a fresh confidence head predicts about 1/2 per slot: blocks are cut
        assert sum(verified) < sum(whole)
        return
    assert verified == whole
    with torch.no_grad():
        assert replay_disagreements(model, draft, greedy) == []


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_a_shorter_draft_over_a_reduced_vocabulary_decodes_losslessly_and_proposes_only_its_tokens(algorithm):
    """What llama.cpp serves with `--spec-draft-n-max 1` and a reduced head: one drafted token per cycle, never a
    token outside the vocabulary, the target's greedy text all the same."""
    model, draft = agreeable_pair(algorithm)
    vocab_size = draft.config.target.vocab_size
    propose, proposed = draft.propose, []

    def recording(*args):
        proposal = propose(*args)
        proposed.append(proposal.tokens)
        return proposal

    draft.propose = recording

    def decoded(vocabulary: torch.Tensor | None) -> torch.Tensor:
        proposed.clear()
        for prompt in PROMPTS:
            run = speculative_generate(model, draft, prompt, BUDGET, set(), max_draft=1, vocabulary=vocabulary)
            assert run.tokens == _greedy(model, prompt, BUDGET), f"lossless at T = 0 on {prompt}"
            assert len(run.slot_attempts) == 1 and set(run.verified_tokens) == {2}
        return torch.cat(proposed)

    with torch.no_grad():
        dropped = decoded(None).mode().values  # the token the whole-vocabulary draft proposes most
        assert not (decoded(torch.arange(vocab_size)[torch.arange(vocab_size) != dropped]) == dropped).any()
        features = torch.randn(6, len(draft.config.target_layer_ids) * draft.config.hidden_size, dtype=torch.float64)
        whole = propose(features, torch.arange(6), 3, 6, None, 0.0, None, torch.arange(vocab_size)).tokens
        assert torch.equal(whole, propose(features, torch.arange(6), 3, 6).tokens)


@pytest.mark.parametrize("algorithm", ["dflash2", "domino", "dspark"])
def test_the_replay_check_fails_for_a_member_that_decodes_its_unary_path(algorithm, monkeypatch):
    """The check above can fail: a copy of the member whose decoding skips its own head (drafting DFlash's
    unary argmax path while `realized` walks the head) disagrees with its replay."""
    model, draft = agreeable_pair(algorithm)
    monkeypatch.setattr(type(draft), "propose_from_hidden", DFlashDraft.propose_from_hidden)
    with torch.no_grad():
        greedy = [speculative_generate(model, draft, p, BUDGET, set(), 0.0, None, 0.0) for p in PROMPTS]
        assert replay_disagreements(model, draft, greedy) != []


def test_each_worker_gets_its_own_device(monkeypatch, tmp_path):
    spawned = []
    monkeypatch.setattr(runner.subprocess, "Popen", lambda args, env: spawned.append((args, env)))
    runner.spawn_workers(tmp_path / "s.yaml", ["cuda:1", "cuda:3"], tmp_path, "sqlite:///x.db")
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in spawned] == ["1", "3"]
    for args, _ in spawned:
        assert args[args.index("--device") + 1] == "cuda" and "--worker" in args
    assert runner.worker_devices("cpu", 1, ["cuda:0", "cuda:1", "cuda:2"]) == ("cuda:0", ["cuda:1", "cuda:2"])
    assert runner.worker_devices("cpu", 3, None) == ("cpu", ["cpu", "cpu"])
    assert runner.pinned("cpu") == ("cpu", {})


def test_devices_and_n_jobs_together_are_refused():
    from studies.cli import parse_devices

    with pytest.raises(SystemExit, match=r"invalid --n-jobs=2 with --devices='cpu,cpu'"):
        parse_devices("cpu,cpu", 2)
    with pytest.raises(SystemExit, match=r"invalid --device='cuda:7'"):
        parse_devices("cuda:7", 1)
    assert parse_devices("cpu, cpu", 1) == ["cpu", "cpu"]


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_anchors_moved_to_a_device_carry_the_host_view_that_slices_the_tiles(algorithm):
    """The training step moves anchors with their host view, so the forward reads nothing back from the device;
    it computes exactly what the forward without one does."""
    from algorithms.blocks import document_starts

    row = packed_row()
    anchors = anchors_for(row)
    moved_row, moved = devices.to_device(row, anchors, "cpu")
    starts, positions, valid = moved.host
    assert positions == anchors.positions.tolist() and valid == anchors.valid.tolist()
    assert starts == document_starts(row.document_ids)[anchors.positions].tolist()
    draft = tiny_draft(algorithm)
    with torch.no_grad():
        with_view = draft.training_forward(moved_row, moved)
        without = draft.training_forward(row, anchors)
    assert torch.equal(with_view.loss, without.loss)


def test_auto_precision_is_bf16_only_on_accelerators_and_cpus_with_native_bf16(tmp_path, monkeypatch):
    from harness import devices

    native, plain = tmp_path / "native", tmp_path / "plain"
    native.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert devices.cpu_has_native_bf16(str(native)) and not devices.cpu_has_native_bf16(str(plain))
    assert not devices.cpu_has_native_bf16(str(tmp_path / "missing"))
    for has_bf16 in (True, False):
        monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda has=has_bf16: has)
        assert devices.uses_bf16("cpu", "auto") is has_bf16
        assert devices.uses_bf16("cuda", "auto") and devices.uses_bf16("cpu", "bf16")
        assert not devices.uses_bf16("cuda", "fp32") and not devices.uses_bf16("cpu", "fp32")


def test_a_shapes_only_build_skips_the_fill_that_would_import_dynamo():
    """`train` checks its knobs on a meta-device draft first; torch's meta `normal_` would import torch._dynamo
    (about 2 s of every command's start-up) to fill values that meta tensors do not have."""
    code = (
        "import sys, torch\n"
        "from harness import devices\n"
        "with devices.shapes_only():\n"
        "    layer = torch.nn.Linear(8, 4)\n"
        "    torch.nn.init.normal_(layer.weight, std=0.02)\n"
        "    layer.weight.normal_()\n"
        "assert layer.weight.is_meta and layer.weight.shape == (4, 8)\n"
        "assert 'torch._dynamo' not in sys.modules, 'a meta fill imported dynamo'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
