"""SIGTERM, as clusters preempt jobs (Slurm, Kubernetes): an interruption like Ctrl-C, recorded and resumable.

Standard library only, so the CLI installs the handler before anything heavy is imported.
"""

from __future__ import annotations

import os
import signal

SIGTERM_EXIT = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM: 143
# Set by a torchrun job's launcher (harness.distributed.run_ranks): the file where rank 0 names the run it
# started, so the launcher can record a run whose rank 0 dies and speak for the whole job.
LAUNCHED_RUN_ENV = "DFLASH_LAB_LAUNCHED_RUN_FILE"


class RankStopped(RuntimeError):
    """This torchrun rank was told to stop: torchrun ends every rank when one of them fails. A failure, not an
    interruption: the run is recorded failed."""


class Preempted(KeyboardInterrupt):
    """Raised where the process is when SIGTERM arrives: every owner on the way out records the interruption."""


def stop_on_preemption() -> None:
    """Turn SIGTERM into `Preempted`; a second SIGTERM during the clean-up is ignored, so it can finish."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Preempted("Preempted: stopped by SIGTERM (preemption or cancellation); resumable")

    signal.signal(signal.SIGTERM, handler)


def exit_quietly_on_sigterm() -> None:
    """A torchrun rank other than 0 owns nothing, and torchrun sends it SIGTERM when another rank fails: it
    leaves at once, and the launcher reports the job in one line."""
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(SIGTERM_EXIT))
