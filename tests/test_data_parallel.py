"""Data parallelism in one process: rank parts of a batch add up to the batch; the helpers of a world of one;
how a rank's process ends."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from algorithms.blocks import Anchors, sample_anchors
from algorithms.metrics import finalize, pool, scalar_counts
from harness.distributed import SINGLE, Ranks, _by_index, _by_name, trainable_names
from harness.train import rank_part

from conftest import packed_row, tiny_draft


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_parts_add_up_to_the_whole_batch(algorithm, world_size):
    """Each rank's loss, scaled by its share, backpropagates to its part of the one-process gradient; the
    ranks' metric counts pool to the one-process counts."""
    draft = tiny_draft(algorithm)
    row = packed_row(doc_lengths=(30, 24), pad=4)
    anchors = sample_anchors(row.loss_mask, row.document_ids, 4, 8, torch.Generator().manual_seed(1))
    whole = draft.training_forward(row, anchors)
    whole.loss.backward()
    expected = [p.grad.clone() for p in draft.parameters()]
    draft.zero_grad()
    counts, loss = {}, 0.0
    for rank in range(world_size):
        part, share = rank_part(draft, row, anchors, Ranks(rank, world_size))
        output = draft.training_forward(row, part)
        (output.loss * share).backward()
        loss += float(output.loss.detach()) * share
        pool(counts, output.counts)
    assert loss == pytest.approx(float(whole.loss.detach()), rel=1e-5)
    for got, want in zip((p.grad for p in draft.parameters()), expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    pooled, one = finalize(counts), finalize(whole.counts)
    assert pooled.keys() == one.keys()
    for name in one:
        assert pooled[name] == pytest.approx(one[name], rel=1e-5, abs=1e-9), name


def test_strided_anchors_partition_the_batch_and_keep_the_host_view():
    positions = torch.tensor([3, 5, 8, 13, 21])
    anchors = Anchors(positions, torch.tensor([True] * 4 + [False]), ([0, 0, 8, 8, 8], [3, 5, 8, 13, 21], [1] * 5))
    parts = [anchors.strided(rank, 2) for rank in range(2)]
    assert [p.positions.tolist() for p in parts] == [[3, 8, 21], [5, 13]]
    assert [p.valid.tolist() for p in parts] == [[True, True, False], [True, True]]
    assert parts[1].host == ([0, 8], [5, 13], [1, 1])


def test_a_rank_without_supervised_positions_adds_nothing():
    row = packed_row(doc_lengths=(30,), pad=0)
    draft = tiny_draft("dflash")
    anchors = Anchors(torch.tensor([4, 10]), torch.tensor([True, False]))  # rank 1 holds only padding
    parts = [rank_part(draft, row, anchors, Ranks(rank, 2)) for rank in range(2)]
    assert parts[0][1] == pytest.approx(1.0) and parts[1][1] == pytest.approx(0.0, abs=1e-5)
    assert float(draft.training_forward(row, parts[1][0]).loss) == 0.0


def test_losses_pool_weighted_by_their_supervised_positions():
    """A loss of 2 over 3 positions and a loss of 5 over 1 pool to (2*3 + 5*1) / 4 = 2.75, by hand."""
    counts = {}
    pool(counts, scalar_counts({"loss": torch.tensor(2.0)}, torch.tensor(3.0)))
    pool(counts, scalar_counts({"loss": torch.tensor(5.0)}, torch.tensor(1.0)))
    assert finalize(counts)["loss"] == 2.75


def test_optimizer_state_is_renamed_and_renumbered_losslessly():
    draft = tiny_draft("dflash2")
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad])
    draft.training_forward(packed_row(), sample_anchors(*_mask_and_docs(), 4, 8)).loss.backward()
    optimizer.step()
    plain = optimizer.state_dict()
    names = trainable_names(draft)
    by_name = _by_name(plain, names)
    assert set(by_name["state"]) == set(names) and by_name["param_groups"][0]["params"] == names
    again = _by_index(by_name, names)
    assert again["param_groups"] == plain["param_groups"]
    assert all(torch.equal(again["state"][i]["exp_avg"], plain["state"][i]["exp_avg"]) for i in plain["state"])


def _mask_and_docs():
    row = packed_row()
    return row.loss_mask, row.document_ids


def test_a_world_of_one_needs_no_process_group():
    assert not SINGLE.distributed and SINGLE.is_main
    assert list(SINGLE.indices(3)) == [0, 1, 2] and list(Ranks(1, 2).indices(5)) == [1, 3]
    assert SINGLE.gather("x") == ["x"] and SINGLE.from_main({"a": 1}) == {"a": 1}
    value = torch.tensor([1.0, 2.0])
    assert SINGLE.sum_(value) is value and value.tolist() == [1.0, 2.0]


RANK_ENDING = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from harness.distributed import exit_rank_after

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "exit-handler").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
    print("buffered", end="")
    class TornDown:  # only the interpreter's teardown deletes a module global
        def __init__(self, path): self.path = path
        def __del__(self, open=open): open(self.path, "w").write("yes")
    keep = TornDown(str(out / "torn-down"))

    def entry():
        if sys.argv[2] == "raises":
            raise ValueError("escaped")
        return 3

    exit_rank_after(entry)
    """
)


@pytest.mark.parametrize("ending", ["returns", "raises"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_rank_ends_with_its_status_after_exit_handlers_threads_and_buffered_output(tmp_path, world_size, ending):
    """A rank of a multi-rank job runs its exit handlers, waits for its threads and flushes its streams, then
    ends without the interpreter's teardown (a module global is never deleted); a world of one exits the
    ordinary way. An exception that escapes the entry point ends the same way, reported as the interpreter
    would: its traceback and status 1."""
    torchrun = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    ended = subprocess.run(
        [sys.executable, "-c", RANK_ENDING, str(tmp_path), ending],
        env={**os.environ, **torchrun},
        capture_output=True,
        text=True,
    )
    if ending == "raises":
        assert ended.returncode == 1 and ended.stderr.strip().splitlines()[-1] == "ValueError: escaped", ended.stderr
    else:
        assert ended.returncode == 3 and ended.stderr == "", ended.stderr
    assert ended.stdout == "buffered"
    assert (tmp_path / "exit-handler").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "torn-down").exists() == (world_size == 1)
