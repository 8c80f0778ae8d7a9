"""bf16 features against fp32 ones: the feature cache's own step over a trained run's documents, computed both
ways on this CPU. Each selected layer's relative difference (harness.features.relative_difference, per document,
then the mean and the largest over documents) against the stated tolerance, both rates in tokens/s, and the CPU's
own fp32 and bf16 matmul rates measured in the same run, so a record says whether bf16 would pay here.

    python -m benchmarks.training.feature_precision --workdir work --run RUN   # a record for FEATURE_PRECISION.md

By default (`train.feature_precision: device`) the harness computes features in bf16 on an accelerator and in fp32
on every CPU, and `auto` computes them in bf16 on a CPU with native bf16 too; this is the check that the two stay
within the tolerance. Run it on a quiet machine: it times extraction.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.common.extraction import extracted, matmul_rate
from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from benchmarks.common.runs import load_run
from harness.data import prepare_documents
from harness.devices import cpu_has_native_bf16
from harness.features import BF16_FEATURE_TOLERANCE, relative_difference

GROUP, PAGE = "training", "FEATURE_PRECISION"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(args: argparse.Namespace) -> Record:
    trained = load_run(args.run, args.workdir)
    target = trained.load_target()
    documents = prepare_documents(target, trained.config.data, trained.run.workdir).train[: args.documents]
    layer_ids = trained.config.algorithm.shared.resolve_target_layer_ids(target.spec.num_hidden_layers)
    extracted(target, documents[:8], layer_ids, "fp32")  # warm-up: the first forward allocates
    reference, fp32_rate = extracted(target, documents, layer_ids, "fp32")
    found, bf16_rate = extracted(target, documents, layer_ids, "bf16")
    per_document = [
        relative_difference(features, expected, len(layer_ids))
        for (features, _), (expected, _) in zip(found, reference, strict=True)
    ]
    layers = list(zip(*per_document, strict=True))
    rates = {name: matmul_rate(dtype, 2048, target.spec.hidden_size, 1536) / 1e9 for name, dtype in DTYPES.items()}
    largest = max(max(layer) for layer in layers)
    tokens = sum(len(d.input_ids) for d in documents)
    rows = [
        [str(layer_id), f"{statistics.fmean(layer):.4f}", f"{max(layer):.4f}"]
        for layer_id, layer in zip(layer_ids, layers, strict=True)
    ]
    verdict = "within" if largest <= BF16_FEATURE_TOLERANCE else "**outside**"
    blocks = [
        f"`{trained.run.name}`'s first {len(documents)} training documents ({tokens} tokens, its own regenerated "
        f"data), the cache step (`batch_features`, batches of 8) on the CPU, native bf16: "
        f"{'yes' if cpu_has_native_bf16() else 'no'}. Relative difference of the bf16-computed features from the "
        "fp32-computed ones, both as the cache stores them (bf16), per selected layer: ||bf16 - fp32|| / ||fp32|| "
        "over a document's tokens.",
        Table(["target layer", "mean over documents", "largest"], rows),
        f"Largest {largest:.4f}: {verdict} the stated tolerance {BF16_FEATURE_TOLERANCE} "
        f"(`harness.features.BF16_FEATURE_TOLERANCE`).",
        f"**Speed**: fp32 {fp32_rate:.0f} tokens/s, bf16 {bf16_rate:.0f} tokens/s ({bf16_rate / fp32_rate:.2f}x). A "
        f"plain 2048 x {target.spec.hidden_size} x 1536 matmul in the same run: {rates['fp32']:.1f} GFLOP/s in fp32, "
        f"{rates['bf16']:.1f} GFLOP/s in bf16 ({rates['bf16'] / rates['fp32']:.2f}x).",
    ]
    values = {
        "documents": len(documents),
        "tokens": tokens,
        "layer_ids": layer_ids,
        "relative_difference_mean": [statistics.fmean(layer) for layer in layers],
        "relative_difference_max": [max(layer) for layer in layers],
        "tolerance": BF16_FEATURE_TOLERANCE,
        "tokens_per_s": {"fp32": fp32_rate, "bf16": bf16_rate},
        "matmul_gflops": rates,
    }
    return Record(f"`{trained.run.name}`, {len(documents)} documents", blocks, values, Provenance.now())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("work"), help="work directory (default: ./work)")
    parser.add_argument("--run", required=True, help="a trained run whose documents are extracted (name or directory)")
    parser.add_argument("--documents", type=int, default=64, help="its first training documents (default: 64)")
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args()
    if args.documents < 1:
        raise SystemExit(f"invalid --documents={args.documents}: allowed an integer >= 1")
    page = Page.named(GROUP, args.page or PAGE).titled("Features computed in bf16 against fp32")
    page.publish(measure(args))


if __name__ == "__main__":
    main()
