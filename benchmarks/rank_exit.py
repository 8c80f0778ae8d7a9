"""How often a two-rank gloo job aborts at exit, with and without `harness.distributed.exit_rank`.

    python -m benchmarks.rank_exit [--runs 40] [--workdir work]

Each run is a two-rank torchrun job that shards a layer with FSDP2 (which keeps the gloo process group alive past
destroy_process_group), all-reduces tensors that carry a Python attribute, leaves the group the way `joined`
does, and ends either with a plain `sys.exit` or with `exit_rank`. The arms alternate run by run while busy
processes keep every core loaded, as a 2-core CI machine is. A rank that aborts while the interpreter finalizes
shows as `killed by SIGABRT`. Writes benchmarks/RANK_EXIT.md and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from harness.distributed import exit_rank, joined, run_ranks

ARMS = ("sys.exit", "exit_rank")
COLLECTIVES = 200


def rank(arm: str) -> None:
    """One rank of a job: the collectives, then the arm's way out."""
    with joined("cpu"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(torch.nn.Linear(4, 4))
        for index in range(COLLECTIVES):
            tensor = torch.ones(1000)
            tensor.index = index  # a Python attribute: torch keeps the PyObject alive with the tensor
            dist.all_reduce(tensor, async_op=True).wait()
            del tensor
    if arm == "exit_rank":
        exit_rank(0)
    sys.exit(0)


def measure(runs: int, scratch: Path) -> dict[str, list[str]]:
    """Each arm's outcomes (`ok` or the lost rank's reason), the arms alternating under full CPU load."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    outcomes: dict[str, list[str]] = {arm: [] for arm in ARMS}
    try:
        for _ in tqdm(range(runs), desc="run pairs"):
            for arm in ARMS:
                ended = run_ranks(2, "benchmarks.rank_exit", ["--rank", arm], scratch)
                outcomes[arm].append("ok" if ended.status == 0 else ended.lost or f"exit status {ended.status}")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return outcomes


def write(outcomes: dict[str, list[str]], path: Path) -> dict:
    summary = {arm: {"runs": len(o), "aborted": sum(x != "ok" for x in o)} for arm, o in outcomes.items()}
    reasons = sorted({x for o in outcomes.values() for x in o if x != "ok"})
    lines = [
        "# A two-rank gloo job's exit, with and without exit_rank",
        "",
        f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by `python -m benchmarks.rank_exit` on this machine "
        f"({os.cpu_count()} cores, all kept busy), torch {torch.__version__}. Each run: 2 ranks, an FSDP2-sharded "
        f"layer, {COLLECTIVES} all-reduces, `joined`'s barrier and destroy_process_group, then the arm's exit.",
        "",
        "| exit | runs | aborted |",
        "|---|---|---|",
        *(f"| `{arm}` | {s['runs']} | {s['aborted']} |" for arm, s in summary.items()),
        "",
        f"Reasons: {', '.join(reasons) if reasons else 'none'}.",
    ]
    path.write_text("\n".join(lines) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs per arm (default 40)")
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="where the launcher's scratch files go")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "RANK_EXIT.md")
    parser.add_argument("--rank", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank(args.rank)
    summary = write(measure(args.runs, args.workdir), args.out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
