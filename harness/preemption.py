"""SIGTERM, as clusters preempt jobs (Slurm, Kubernetes): an interruption like Ctrl-C, recorded and resumable.

Standard library only, so the CLI installs the handler before anything heavy is imported.
"""

from __future__ import annotations

import os
import signal

SIGTERM_EXIT = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM: 143


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
