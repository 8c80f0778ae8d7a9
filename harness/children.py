"""Child processes that never outlive the process that started them, however it dies (SIGKILL included)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Resolved here, in the parent: the child between fork and exec only calls it (loading a library there could wait
# forever on a lock another thread of the parent held at the fork).
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent: int, death_signal: int) -> None:
    """Run in the child between fork and exec: the kernel sends it `death_signal` when its parent dies. Should the
    parent (`parent`, its pid before the fork) already be gone, exit at once: the signal would never come. The
    signal follows the thread that started the child, so a child is started and waited for by one thread."""
    if PRCTL(PR_SET_PDEATHSIG, death_signal) != 0 or os.getppid() != parent:
        os._exit(1)


def dying_with_this_process(death_signal: int = signal.SIGKILL) -> Callable[[], None] | None:
    """The `preexec_fn` for a child that must die with this process (None where the OS has no such signal)."""
    return functools.partial(die_with_parent, os.getpid(), death_signal) if PRCTL is not None else None
