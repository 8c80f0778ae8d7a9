"""SIGTERM, as clusters preempt jobs (Slurm, Kubernetes): an interruption like Ctrl-C, recorded and resumable.

Standard library only, so the CLI installs the handler before anything heavy is imported.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from typing import TypeVar

SIGTERM_EXIT = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM: 143
# Set by a torchrun job's launcher (harness.distributed.run_ranks): the file where rank 0 names the run it
# started, so the launcher can record a run whose rank 0 dies and speak for the whole job.
LAUNCHED_RUN_ENV = "DFLASH_LAB_LAUNCHED_RUN_FILE"
# ... and the file it creates just before it stops the job (SIGTERM to torchrun): from then on a rank whose
# collective fails because a peer has already left is being stopped, not failing, and leaves quietly.
JOB_STOPPING_ENV = "DFLASH_LAB_JOB_STOPPING_FILE"


def job_stopping() -> bool:
    """Whether this torchrun rank's dflash-lab launcher is stopping the job."""
    marker = os.environ.get(JOB_STOPPING_ENV)
    return bool(marker) and os.path.exists(marker)


class RankStopped(RuntimeError):
    """This torchrun rank was told to stop: torchrun ends every rank when one of them fails. A failure, not an
    interruption: the run is recorded failed."""


class Preempted(KeyboardInterrupt):
    """Raised where the process is when SIGTERM arrives: every owner on the way out records the interruption."""


PREEMPTED = "Preempted: stopped by SIGTERM (preemption or cancellation); resumable"
# While above 0, the process is inside a write to the tracking store: a SIGTERM then waits for the write's end
# (an exception raised inside a database transaction can leave its connection holding the store's lock, and
# the interruption could then never be recorded).
_deferring = 0
_pending = False


def stop_on_preemption() -> None:
    """Turn SIGTERM into `Preempted`; a second SIGTERM during the clean-up is ignored, so it can finish."""

    def handler(signum: int, frame: object) -> None:
        global _pending
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _deferring:
            _pending = True
            return
        raise Preempted(PREEMPTED)

    signal.signal(signal.SIGTERM, handler)


Function = TypeVar("Function", bound=Callable)


def deferring_preemption(function: Function) -> Function:
    """`function` runs whole: a SIGTERM that arrives during it raises `Preempted` when it returns."""

    @functools.wraps(function)
    def deferred(*args, **kwargs):
        global _deferring, _pending
        _deferring += 1
        try:
            return function(*args, **kwargs)
        finally:
            _deferring -= 1
            if not _deferring and _pending:
                _pending = False
                raise Preempted(PREEMPTED)

    return deferred  # type: ignore[return-value]


def exit_quietly_on_sigterm() -> None:
    """A torchrun rank other than 0 owns nothing, and torchrun sends it SIGTERM when another rank fails: it
    leaves at once, and the launcher reports the job in one line."""
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(SIGTERM_EXIT))
