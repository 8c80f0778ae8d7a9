"""Does storing the final hidden state in bf16 move the metrics? Runs of one config on the embedded target: the
cache as is (fp32 final state), and the same features with the final state rounded to bf16, which is how the
cache stores it for a bf16 target; everything else (seed, rows, anchors, validation documents) is shared. Two
references tell the effect apart from noise: the fp32-trained draft measured against both final states (the
rounding's effect on the measurement alone), and a second fp32 run with another seed (how far any change of the
training trajectory moves the metrics).

    python -m benchmarks.training.final_dtype [--study studies/default.yaml] [--steps 100] [--workdir work]

Prints one JSON line and adds a record to benchmarks/training/FINAL_DTYPE.md: each headline metric of both runs
with its interval, and the differences paired by validation document.
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
from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.run import VALIDATION_DOCUMENTS_FILE
from harness.train import Workspace, prepare_workspace, train
from harness.uncertainty import paired_difference, t_interval
from harness.validation import pairs, validate_documents
from studies.schema import load_study

GROUP, PAGE = "training", "FINAL_DTYPE"
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
    bf16 = with_bf16_final(workspace)
    stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
    results, documents, drafts = {}, {}, {}
    for label, space, seed in (("fp32", workspace, 0), ("bf16", bf16, 0), ("fp32-seed1", workspace, 1)):
        seeded = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed))
        result = train(seeded, space, run_name=f"final-dtype-{label}-{stamp}", experiment="dflash-lab/final-dtype")
        results[label], drafts[label] = result.validation, result.draft
        documents[label] = pd.read_csv(result.run_dir / VALIDATION_DOCUMENTS_FILE)
    precision = config.train.precision
    measured_bf16 = validate_documents(drafts["fp32"], bf16.validation_documents, "cpu", precision).documents
    differences = {
        "measurement_only": (measured_bf16, documents["fp32"]),
        "bf16_minus_fp32": (documents["bf16"], documents["fp32"]),
        "seed1_minus_seed0": (documents["fp32-seed1"], documents["fp32"]),
    }
    record = {"study": str(study), "steps": steps, "documents": int(results["fp32"]["num_documents"]), "metrics": {}}
    for name in HEADLINE_METRICS:
        if name + ":sum" not in documents["fp32"]:
            continue
        n = record["documents"]
        runs = {
            label: t_interval(results[label][name], results[label].get(se_name(name), float("nan")), n).text()
            for label in ("fp32", "bf16")
        }
        paired = {
            label: paired_difference(*pairs(a, name), *pairs(b, name)).text() for label, (a, b) in differences.items()
        }
        record["metrics"][name] = runs | paired
    return record


def as_record(found: dict) -> Record:
    about = "\n".join(
        [
            f"- Config: the base of `{found['study']}`, {found['steps']} steps, one seed, the embedded SmolLM2-135M "
            "target; the bf16 run's final hidden states (training and validation) are the cache's fp32 ones rounded "
            "to bf16.",
            f"- Final validation: every anchor of {found['documents']} documents; 95% intervals; differences are "
            "paired by document, so their intervals hold anchor noise only, not training noise.",
            "- Columns: each run's metric; *measurement only*: the fp32-trained draft measured against bf16-rounded "
            "minus fp32 final states; *bf16 - fp32*: the two trained runs; *seed 1 - seed 0*: two fp32 runs whose "
            "seeds differ, the size of a change of training trajectory.",
        ]
    )
    columns = ["metric", "fp32 final state", "bf16 final state", "measurement only", "bf16 - fp32", "seed 1 - seed 0"]
    rows = [
        [name, v["fp32"], v["bf16"], v["measurement_only"], v["bf16_minus_fp32"], v["seed1_minus_seed0"]]
        for name, v in found["metrics"].items()
    ]
    return Record(f"{found['steps']} steps", [about, Table(columns, rows)], found, Provenance.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, default=Path("studies/default.yaml"), help="whose base config to train")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=Path("work"))
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    record = measure(args.study, args.steps, args.workdir)
    print(json.dumps(record), flush=True)
    page = Page.named(GROUP, args.page or PAGE)
    print(f"recorded {page.add(as_record(record))}; rendered {page.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
