"""How often a two-rank gloo job aborts at exit, with and without `harness.distributed.exit_rank`.

    python -m benchmarks.training.rank_exit [--runs 40] [--workdir work]

Each run is a two-rank torchrun job that shards a layer with FSDP2 (which keeps the gloo process group alive past
destroy_process_group), all-reduces tensors that carry a Python attribute, leaves the group the way `joined`
does, and ends either with a plain `sys.exit` or with `exit_rank`. The arms alternate run by run while busy
processes keep every core loaded, as a 2-core CI machine is. A rank that aborts while the interpreter finalizes
shows as `killed by SIGABRT`. Adds a record to benchmarks/training/RANK_EXIT.md; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.distributed import exit_rank, joined, run_ranks

GROUP, PAGE = "training", "RANK_EXIT"
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
                ended = run_ranks(2, "benchmarks.training.rank_exit", ["--rank", arm], scratch)
                outcomes[arm].append("ok" if ended.status == 0 else ended.lost or f"exit status {ended.status}")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return outcomes


def record(outcomes: dict[str, list[str]]) -> Record:
    summary = {arm: {"runs": len(o), "aborted": sum(x != "ok" for x in o)} for arm, o in outcomes.items()}
    reasons = sorted({x for o in outcomes.values() for x in o if x != "ok"})
    about = (
        f"Every core kept busy. Each run: 2 ranks, an FSDP2-sharded layer, {COLLECTIVES} all-reduces, `joined`'s "
        "barrier and destroy_process_group, then the arm's exit."
    )
    rows = [[f"`{arm}`", str(s["runs"]), str(s["aborted"])] for arm, s in summary.items()]
    blocks = [about, Table(["exit", "runs", "aborted"], rows), f"Reasons: {', '.join(reasons) if reasons else 'none'}."]
    return Record(f"{sum(s['runs'] for s in summary.values())} runs", blocks, summary, Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs per arm (default 40)")
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="where the launcher's scratch files go")
    page_argument(parser, GROUP, PAGE)
    parser.add_argument("--rank", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank(args.rank)
    found = record(measure(args.runs, args.workdir))
    page = Page.named(GROUP, args.page or PAGE)
    print(json.dumps(found.values))
    print(f"recorded {page.add(found)}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
