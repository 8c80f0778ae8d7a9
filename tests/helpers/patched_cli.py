"""`dflash-lab` with a test's fault or setting injected, runnable under torchrun as a script.

Environment: FAULT_RANK, FAULT_STEP and FAULT_KIND (`raise`: the rank raises; `kill`: it SIGKILLs itself;
`hang`: it stops answering) stop one rank as its training step FAULT_STEP begins; DOCS_PER_SHARD sets the
feature cache's shard size.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import cli, features, train  # noqa: E402


def inject_fault() -> None:
    rank, step, kind = int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"]), os.environ["FAULT_KIND"]
    original = train.TrainingRecipe.step

    def step_with_fault(recipe, index):
        if recipe.ranks.rank == rank and index + 1 == step:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        return original(recipe, index)

    train.TrainingRecipe.step = step_with_fault


if __name__ == "__main__":
    if "FAULT_RANK" in os.environ:
        inject_fault()
    if "DOCS_PER_SHARD" in os.environ:
        features.DOCS_PER_SHARD = int(os.environ["DOCS_PER_SHARD"])
    sys.exit(cli.main(sys.argv[1:]))
