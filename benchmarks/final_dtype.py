"""Does storing the final hidden state in bf16 move the metrics? Two runs of one config on the embedded target:
the cache as is (fp32 final state), and the same features with the final state rounded to bf16, which is how
the cache stores it for a bf16 target. Everything else (seed, rows, anchors, validation documents) is shared.

    python -m benchmarks.final_dtype [--study studies/default.yaml] [--steps 100] [--workdir work]

Prints one JSON line and writes benchmarks/FINAL_DTYPE.md: each headline metric of both runs with its interval,
and their difference paired by validation document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import torch

from algorithms.blocks import PackedRow
from algorithms.metrics import HEADLINE_METRICS, se_name
from harness.run import VALIDATION_DOCUMENTS_FILE
from harness.train import Workspace, prepare_workspace, train
from harness.uncertainty import paired_difference, t_interval
from harness.validation import pairs
from studies.schema import load_study

FINAL_AS = torch.bfloat16


def rounded(rows: list[PackedRow]) -> list[PackedRow]:
    return [dataclasses.replace(row, target_hidden=row.target_hidden.to(FINAL_AS)) for row in rows]


def with_bf16_final(workspace: Workspace) -> Workspace:
    """The workspace's rows with the final hidden state as a bf16 cache holds it."""
    return dataclasses.replace(
        workspace,
        train_rows=rounded(workspace.train_rows),
        validation_rows=rounded(workspace.validation_rows),
        validation_documents=rounded(workspace.validation_documents),
    )


def measure(study: Path, steps: int, workdir: Path) -> dict:
    definition = load_study(study)
    config = definition.base
    config.train = dataclasses.replace(config.train, max_steps=steps, eval_every=steps, checkpoint_every=steps)
    workspace = prepare_workspace(config, workdir)
    stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
    results, documents = {}, {}
    for label, space in (("fp32", workspace), ("bf16", with_bf16_final(workspace))):
        result = train(config, space, run_name=f"final-dtype-{label}-{stamp}", experiment="dflash-lab/final-dtype")
        results[label] = result.validation
        documents[label] = pd.read_csv(result.run_dir / VALIDATION_DOCUMENTS_FILE)
    record = {"study": str(study), "steps": steps, "documents": int(results["fp32"]["num_documents"]), "metrics": {}}
    for name in HEADLINE_METRICS:
        if name + ":sum" not in documents["fp32"]:
            continue
        n = record["documents"]
        record["metrics"][name] = {
            label: t_interval(results[label][name], results[label].get(se_name(name), float("nan")), n).text()
            for label in results
        } | {
            "bf16_minus_fp32": paired_difference(
                *pairs(documents["bf16"], name), *pairs(documents["fp32"], name)
            ).text()
        }
    return record


def write(record: dict, path: Path) -> None:
    lines = [
        "# Final hidden state in bf16 vs fp32 in the feature cache",
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; embedded SmolLM2-135M target, CPU.",
        f"- Config: the base of `{record['study']}`, {record['steps']} steps, one seed; the bf16 run's final hidden "
        "states (training and validation) are the cache's fp32 ones rounded to bf16.",
        f"- Final validation: every anchor of {record['documents']} documents; 95% intervals; the difference is "
        "paired by document (anchor noise only: training noise from the rounding is not separated from it).",
        "",
        "| metric | fp32 final state | bf16 final state | bf16 - fp32 |",
        "|---|---|---|---|",
        *(
            f"| {name} | {values['fp32']} | {values['bf16']} | {values['bf16_minus_fp32']} |"
            for name, values in record["metrics"].items()
        ),
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, default=Path("studies/default.yaml"), help="whose base config to train")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=Path("work"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "FINAL_DTYPE.md")
    args = parser.parse_args(argv)
    record = measure(args.study, args.steps, args.workdir)
    print(json.dumps(record), flush=True)
    write(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
