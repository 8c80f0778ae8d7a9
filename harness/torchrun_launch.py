"""torchrun itself, with a lost rank written down instead of thrown as the agent's traceback.

`run_ranks` starts `python -m harness.torchrun_launch <torchrun args>`; when a rank dies (a signal, a crash)
torchrun's agent raises ChildFailedError. Here that becomes one JSON record at RANK_FAILURE_ENV's path, which
the launching `dflash-lab` process reads to record the run failed with the reason, and an exit status of 1.
A SIGTERM to torchrun itself (a scheduler preempting the whole job) ends it with 128 + the signal, quietly too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

from harness.distributed import RANK_FAILURE_ENV


def lost_rank_reason(rank: int, exitcode: int) -> str:
    """`rank 0 lost (killed by SIGKILL)`, `rank 1 lost (exit status 1)`."""
    if exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exit status {exitcode}"
    return f"rank {rank} lost ({how})"


class WithoutFailedRank(logging.Filter):
    """Drops the agent's `failed (exitcode: -9) local_rank: 0 ...` and `Sending process N closing signal`
    records when a rank fails: the launcher's one line says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


if __name__ == "__main__":
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(WithoutFailedRank())
    try:
        main()
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        if RANK_FAILURE_ENV in os.environ:
            record = {"rank": rank, "exitcode": failure.exitcode, "reason": lost_rank_reason(rank, failure.exitcode)}
            with open(os.environ[RANK_FAILURE_ENV], "w") as out:
                json.dump(record, out)
        sys.exit(1)
    except SignalException as stop:  # SIGTERM to the whole job (a scheduler's preemption): the ranks are stopped
        sys.exit(128 + stop.sigval)
