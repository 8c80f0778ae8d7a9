"""Data-parallel ranks on PyTorch's own engine: torchrun starts the processes, torch.distributed connects them
(nccl on CUDA, gloo on the CPU) and FSDP2 shards the draft. One process without torchrun is the world of one,
and every helper here is then a no-op, so training has one code path.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from harness.children import dying_with_this_process
from harness.files import remove
from harness.preemption import JOB_STOPPING_ENV, LAUNCHED_RUN_ENV, RankStopped

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Set for harness.torchrun_launch: where it writes the first failed rank of a job.
RANK_FAILURE_ENV = "DFLASH_LAB_RANK_FAILURE_FILE"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks of one training run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 owns the run: its directory, its MLflow run, its progress bar."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def indices(self, count: int) -> range:
        """This rank's disjoint share of `count` items (documents, rows): every world_size-th from its rank."""
        return range(self.rank, count, self.world_size)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce in place: every rank ends with the sum over ranks."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def from_main(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


SINGLE = Ranks()


@dataclass(frozen=True)
class RanksExit:
    """How a torchrun job ended, as its launcher saw it."""

    status: int
    lost: str | None  # torchrun's first failed rank as a reason: `rank 0 lost (killed by SIGKILL)`
    run_directory: Path | None  # the run rank 0 had started, if it got that far


def run_ranks(
    nproc_per_node: int, module: str, args: list[str], scratch: Path, env: dict[str, str] | None = None
) -> RanksExit:
    """`python -m <module> <args>` as `nproc_per_node` ranks under torchrun on this machine.

    torchrun pins each rank to one thread unless told otherwise: on the CPU the ranks share the cores instead.
    The ranks die with the calling process (Linux), so a killed study worker leaves no orphaned trial. Two
    small files in `scratch` (the work directory) carry back which rank failed and which run rank 0 started,
    so the launcher can record a run whose rank 0 died without a word."""
    scratch.mkdir(parents=True, exist_ok=True)
    failure, launched, stopping = (
        scratch / f".{kind}-{os.getpid()}.json" for kind in ("rank-failure", "launched-run", "job-stopping")
    )
    threads = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    environment = {
        "OMP_NUM_THREADS": threads,
        **os.environ,
        **(env or {}),
        RANK_FAILURE_ENV: str(failure),
        LAUNCHED_RUN_ENV: str(launched),
        JOB_STOPPING_ENV: str(stopping),
    }
    command = [sys.executable, "-m", "harness.torchrun_launch", "--standalone", f"--nproc-per-node={nproc_per_node}"]
    command += ["-m", module, *args]
    log.info("launching %d ranks: %s", nproc_per_node, " ".join(command))

    def started_run() -> Path | None:
        return Path(json.loads(launched.read_text())["directory"]) if launched.exists() else None

    job = subprocess.Popen(command, env=environment, preexec_fn=dying_with_this_process(signal.SIGTERM))
    try:
        try:
            status = job.wait()
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM to the launcher: the job stops, recorded as such
            stopping.touch()
            stop_job(job)
            from harness.run import Run  # here: the parser and the ranks import this module without MLflow
            from harness.tracking import RunStatus

            if (directory := started_run()) is not None:
                reason = str(stop) or type(stop).__name__
                Run.at(directory).record_ending(RunStatus.INTERRUPTED, reason, unless_ended=False)
            raise
        lost = json.loads(failure.read_text())["reason"] if failure.exists() else None
        directory = started_run()
    finally:
        for scratch_file in (failure, launched, stopping):
            remove(scratch_file)
    return RanksExit(status, lost, directory)


def stop_job(job: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to torchrun, which stops its ranks (rank 0 records its run); SIGKILL after `grace_s`."""
    job.send_signal(signal.SIGTERM)
    try:
        job.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV)


def in_multi_rank_job() -> bool:
    """This process is one of several torchrun ranks (torchrun with one rank is a world of one)."""
    return launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join(device: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> tuple[Ranks, str]:
    """Join the process group torchrun set up (or stay a world of one) and return this rank's device:
    `cuda:<local rank>` on CUDA, the CPU otherwise. A collective that waits longer than `timeout_s` for a
    lost rank fails instead of hanging."""
    if not in_multi_rank_job():
        return SINGLE, device
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if torch.device(device).type == "cuda":
        device = f"cuda:{ranks.local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    if ranks.is_main:
        stop_on_sigterm()
    log.info("rank %d of %d on %s (%s)", ranks.rank, ranks.world_size, device, dist.get_backend())
    return ranks, device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def joined(device: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Iterator[tuple[Ranks, str]]:
    """`join` for the duration of a command: only rank 0 logs below warnings, and the process group ends on
    exit, after every rank got there when none failed."""
    ranks, device = join(device, timeout_s)
    if not ranks.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        yield ranks, device
        ranks.barrier()  # no rank tears its group down while a peer still talks to it; after a failure none will
    finally:
        leave()


def exit_rank(status: int | None) -> NoReturn:
    """End a torchrun rank's process with `status`, skipping the interpreter's final teardown in a multi-rank job.

    FSDP2's device meshes keep the gloo process group, and its worker threads, alive past destroy_process_group.
    A worker that drops the last reference to a tensor while the interpreter finalizes cannot take the GIL and
    aborts the whole process ("terminate called without an active exception", exit -6): under CPU load, 5 of 40
    two-rank jobs did with sys.exit, none of 40 through here (benchmarks/training/RANK_EXIT.md). Exit handlers (MLflow,
    logging) still run and the streams are flushed; the process then ends before finalization."""
    if not in_multi_rank_job():
        sys.exit(status)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


def exit_rank_after(entry: Callable[[], int | None]) -> NoReturn:
    """Run a torchrun rank's entry point and end through exit_rank whatever way it ends: an exception that escapes
    is reported as the interpreter would (its traceback on stderr, status 1) instead of ending in the teardown
    that exit_rank avoids."""
    try:
        status = entry()
    except SystemExit as stop:
        status = stop.code
        if isinstance(status, str):  # sys.exit("message"): the message on stderr, status 1
            print(status, file=sys.stderr)
            status = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    exit_rank(status)


def stop_on_sigterm() -> None:
    """Turn torchrun's SIGTERM (sent to every rank when one fails) into an exception, so the run owner records
    the failure instead of vanishing. torchrun allows 30 s before SIGKILL; a rank already handling a failure (a
    collective that lost its peer) is left to record that one, and later SIGTERMs are ignored."""

    def handler(signum: int, frame: object) -> None:
        if sys.exc_info()[0] is not None:
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise RankStopped(
            "stopped by SIGTERM: torchrun stops every rank when one fails (its log names the failing rank), "
            "or the job was cancelled"
        )

    signal.signal(signal.SIGTERM, handler)


def shard(draft: torch.nn.Module, ranks: Ranks, bf16: bool) -> torch.nn.Module:
    """FSDP2: each decoder layer, then the rest, sharded over the ranks; bf16 compute with fp32 gradient
    reduction when `bf16`. The frozen target embedding and head are buffers, replicated on every rank."""
    if not ranks.distributed:
        return draft
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = {"mp_policy": policy} if policy is not None else {}
    for layer in draft.layers:
        fully_shard(layer, **options)
    fully_shard(draft, **options)
    return draft


def full_state(draft: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> tuple[dict, dict]:
    """The model and optimizer state as one process holds them (plain tensors, the optimizer keyed by
    parameter index), gathered to rank 0's CPU: a checkpoint any world size can resume."""
    if not ranks.distributed:
        return draft.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(draft, options=options)
    by_name = get_optimizer_state_dict(draft, optimizer, options=options)
    if not ranks.is_main:
        return {}, {}
    return model, _by_index(by_name, trainable_names(draft))


def load_full_state(
    draft: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict, optimizer_state: dict, ranks: Ranks
) -> None:
    """Load a full (any world size's) state; under FSDP rank 0's copy is scattered to every rank's shards."""
    if not ranks.distributed:
        draft.load_state_dict(model)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(draft, model if ranks.is_main else {}, options=options)
    by_name = _by_name(optimizer_state, trainable_names(draft)) if ranks.is_main else {}
    set_optimizer_state_dict(draft, optimizer, by_name, options=options)


def trainable_names(draft: torch.nn.Module) -> list[str]:
    """The optimizer's parameters in order: a plain optimizer state dict numbers them so."""
    return [name for name, parameter in draft.named_parameters() if parameter.requires_grad]


def _by_index(state: dict, names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def _by_name(state: dict, names: list[str]) -> dict:
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def unsharded_copy(draft: torch.nn.Module, replica: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """`replica` (a plain draft of the same config) holding the sharded draft's current weights on every
    rank: validation and inference run on it without collectives, so ranks may do unequal work."""
    if not ranks.distributed:
        return draft
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    replica.load_state_dict(get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True)))
    return replica


def plain_number(value: torch.Tensor) -> float:
    """A reduced scalar, also when FSDP returns it as a DTensor (the clipped gradient norm)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)
