"""The GPU acceptance check: every user-facing command, end to end on CUDA, on the embedded target.

    python -m benchmarks.training.gpu_check [--device cuda] [--workdir work/gpu-check] [--target-dir DIR] [--out FILE]
    python -m benchmarks.training.gpu_check --cpu-dry-run      # the same steps on the CPU at toy sizes (CI)

Steps: prepare (reusing the cache), 100 DFlash2 steps under bf16 autocast with validation, evaluate on 5
MT-bench prompts at T = 0 (token identity with the target's own greedy decoding) and T = 1, export and a
load of the export in Z Lab's dflash 0.1.0 with identical hidden states, the syncs per training step (the goal is
zero) and per decoding cycle under `torch.cuda.set_sync_debug_mode`, vLLM serving the DFlash and DFlash2 exports
(where vllm imports), the train-step benchmark against speculators 0.9.0 at the qwen3-8b shape, data-parallel
scaling over every GPU of the machine (torchrun, FSDP2; recorded as not measured on a one-GPU machine), and the
DFlash2-over-DFlash overhead. One JSON summary holds every figure with pass or fail per step; the exit status is
non-zero when any step failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RUN_NAME, DFLASH_RUN_NAME = "gpu-check", "gpu-check-dflash"
EMBEDDED_TARGET = "smollm2-135m"
DEFAULT_WORKDIR = Path("work") / "gpu-check"  # inside the project's (ignored) default work directory


@dataclass(frozen=True)
class Sizes:
    """What each step runs: the real check, or the toy dry run that keeps the script from rotting."""

    data: tuple[str, ...]
    precision: str  # of the training step
    train_steps: int
    sync_steps: int  # training steps counted under the sync debug mode, after two warm-up steps
    prompts: int
    new_tokens: int
    train_step_benchmark: tuple[str, ...]
    overhead: tuple[str, ...]
    data_parallel: tuple[str, ...]


REAL = Sizes(
    data=(),
    precision="bf16",
    train_steps=100,
    sync_steps=10,
    prompts=5,
    new_tokens=64,
    train_step_benchmark=("--sizes", "qwen3-8b", "--algorithms", "dflash", "dflash2", "--precisions", "bf16"),
    overhead=(),
    data_parallel=("--sizes", "qwen3-8b", "--algorithms", "dflash2", "--precisions", "bf16"),
)
DRY = Sizes(
    # the end-to-end tests' data: a CI run reuses their cache
    data=("--num-conversations", "40", "--num-validation", "8", "--max-new-tokens", "48", "--max-length", "192")
    + ("--row-length", "512", "--max-anchors", "8"),
    precision="auto",  # fp32 on a CPU without native bf16 (emulated bf16 made this step 153 s of the 361)
    train_steps=4,
    sync_steps=1,
    prompts=1,
    new_tokens=8,
    # DFlash2 alone: it runs every part DFlash does (and tests/test_parity_speculators.py pins both to the peer)
    train_step_benchmark=("--smoke", "--algorithms", "dflash2"),
    overhead=("--size", "tiny", "--steps", "1", "--cycles", "1", "--precisions", "fp32"),
    data_parallel=("--sizes", "tiny", "--algorithms", "dflash2", "--smoke"),
)


def cli(*args: str, timeout: int = 1800) -> str:
    """One dflash-lab command; its stdout, or an error with the last lines of stderr."""
    return command([sys.executable, "-m", "harness.cli", *args], timeout)


def command(args: list[str], timeout: int) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:5])} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return done.stdout


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


class Check:
    """The steps, sharing one work directory and device."""

    def __init__(self, device: str, workdir: Path, sizes: Sizes, target: str = EMBEDDED_TARGET) -> None:
        self.device, self.workdir, self.sizes, self.target = device, workdir, sizes, target
        self.common = ("--workdir", str(workdir), "--device", device)
        self.inputs = ("--target", target, *sizes.data)

    def prepare(self) -> dict:
        out = cli("prepare", *self.common, *self.inputs)
        return {"feature_cache": "reused" if "features reused" in out else "built"}

    def train(self, algorithm: str = "dflash2", run_name: str = RUN_NAME) -> dict:
        steps = str(self.sizes.train_steps)
        every = str(max(1, self.sizes.train_steps // 2))
        args = ["train", *self.common, *self.inputs, "--algorithm", algorithm, "--precision", self.sizes.precision]
        args += ["--max-steps", steps, "--eval-every", every, "--checkpoint-every", every, "--run-name", run_name]
        run_dir = self.workdir / "runs" / run_name
        if run_dir.exists():
            args.append("--resume")  # a rerun of the script continues (or re-reads) the finished run
        started = time.perf_counter()
        out = cli(*args)
        validation = json.loads(out[out.index("{") : out.rindex("}") + 1])
        return {
            "seconds": time.perf_counter() - started,
            **{key: validation[key] for key in validation if "accepted_length" in key or key == "num_anchors"},
        }

    def evaluate(self) -> dict:
        args = ["evaluate", RUN_NAME, *self.common, "--num-prompts", str(self.sizes.prompts)]
        out = cli(*args, "--max-new-tokens", str(self.sizes.new_tokens), "--temperatures", "0", "1")
        figures = {
            line.split(":")[0].removeprefix("eval/"): float(line.split(":")[1])
            for line in out.splitlines()
            if line.startswith("eval/")
        }
        if figures.get("mtbench_lossless_fraction") != 1.0:
            raise AssertionError(f"T = 0 decoding differs from the target's greedy tokens: {figures}")
        return figures

    def export(self) -> dict:
        """Export, then the same block through ours and Z Lab's loaded export: identical hidden states."""
        import torch

        from harness.export import load_exported_weights
        from harness.features import target_features
        from harness.run import Run
        from harness.targets import load_target
        from harness.train import TrainedRun

        out = self.workdir / "gpu-check-export"
        cli("export", RUN_NAME, "--workdir", str(self.workdir), "--out", str(out), "--force")
        from dflash import model as zlab

        torch.backends.cuda.matmul.allow_tf32 = False  # compare in true fp32
        target = load_target(self.target, self.workdir, device=self.device)
        draft = load_exported_weights(TrainedRun.load(Run(self.workdir, RUN_NAME)).draft(target), out)
        draft = draft.to(self.device).eval()
        architecture = json.loads((out / "config.json").read_text())["architectures"][0]
        theirs = getattr(zlab, architecture).from_pretrained(out, dtype=torch.float32).to(self.device).eval()
        prompt = target.tokenizer("Name three rivers in Europe.", return_tensors="pt")["input_ids"].to(self.device)
        with torch.no_grad():
            hidden = target.model(input_ids=prompt, output_hidden_states=True).hidden_states
            features = target_features(hidden, draft.config.target_layer_ids)[0]
            length, anchor = features.shape[0], int(prompt[0, -1])
            positions = torch.arange(length, device=self.device)
            ours = draft.single_block_hidden(features, positions, anchor, length, draft.block_size)
            block_ids = torch.full((draft.block_size,), draft.config.mask_token_id, device=self.device)
            block_ids[0] = anchor
            reference = theirs(
                position_ids=torch.arange(length + draft.block_size, device=self.device)[None],
                noise_embedding=draft.embed_weight[block_ids][None],
                target_hidden=features[None],
            )[0]
        difference = float((ours - reference).abs().max())
        if difference > 1e-3:
            raise AssertionError(f"hidden states differ from Z Lab's by up to {difference:.2e}")
        return {"max_abs_hidden_difference": difference, "export": str(out)}

    def syncs(self) -> dict:
        """Host syncs per training step (the goal is zero: the README's claim, also checked on CI's stand-in) and
        per decoding cycle (acceptance is read by design), counted by `torch.cuda.set_sync_debug_mode("warn")`."""
        if not self.device.startswith("cuda"):
            return {"not_measured": "the sync debug mode counts CUDA syncs; this is the CPU dry run"}
        import torch

        from harness.decode import speculative_generate
        from harness.evaluate import prompt_ids
        from harness.mtbench import mtbench_questions
        from harness.run import Run
        from harness.train import TrainedRun, TrainingRecipe, prepare_workspace

        trained = TrainedRun.load(Run(self.workdir, RUN_NAME))
        workspace = prepare_workspace(trained.config, self.workdir, self.device)
        recipe = TrainingRecipe(trained.config, workspace, run=None, device=self.device)
        for step in range(2):  # warm-up: allocator, cuBLAS handles, autotuning
            recipe.step(step)
        torch.cuda.synchronize(self.device)
        with counted_syncs() as training:
            for step in range(2, 2 + self.sizes.sync_steps):
                recipe.step(step)
        target, draft = workspace.target, trained.draft(workspace.target, self.device)
        prompt = prompt_ids(target.tokenizer, mtbench_questions(1)[0])
        stop = {target.tokenizer.eos_token_id}
        with torch.no_grad(), counted_syncs() as decoding:
            stats = speculative_generate(target.model, draft, prompt, self.sizes.new_tokens, stop)
        cycles = max(1, len(stats.acceptance_lengths))
        return {
            "syncs_per_training_step": len(training) / self.sizes.sync_steps,
            "training_sync_sites": sync_sites(training),
            "syncs_per_decoding_cycle": len(decoding) / cycles,
            "decoding_cycles": cycles,
            "decoding_sync_sites": sync_sites(decoding),
        }

    def vllm_serving(self) -> dict:
        """vLLM's `dflash` speculative method serving the DFlash and DFlash2 exports on the target, offline, on
        the MT-bench prompts `evaluate` decodes: vLLM's accepted length beside ours and the run's offline one."""
        if not self.device.startswith("cuda"):
            return {"skipped": "vLLM serves on a GPU; this is the CPU dry run"}
        try:
            import vllm
        except ImportError as error:
            return {"not_available": f"vllm does not import here ({error})"}
        self.train("dflash", DFLASH_RUN_NAME)
        return {
            "vllm": vllm.__version__,
            **{
                algorithm: self.served(run_name)
                for algorithm, run_name in (("dflash", DFLASH_RUN_NAME), ("dflash2", RUN_NAME))
            },
        }

    def served(self, run_name: str) -> dict:
        from vllm import LLM, SamplingParams

        from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
        from harness.mtbench import mtbench_questions
        from harness.run import Run
        from harness.targets import load_target
        from harness.tracking import EVAL_PREFIX, VAL_PREFIX, client, metric_key
        from harness.train import TrainedRun

        export = self.workdir / f"{run_name}-export"
        cli("export", run_name, "--workdir", str(self.workdir), "--out", str(export), "--force")
        cli(
            "evaluate", run_name, *self.common, "--num-prompts", str(self.sizes.prompts),
            "--max-new-tokens", str(self.sizes.new_tokens), "--temperatures", "0",
        )  # fmt: skip
        run = Run(self.workdir, run_name)
        shared = TrainedRun.load(run).config.algorithm.shared
        slots = shared.block_size - shared.first_draft_slot
        speculative = {"method": "dflash", "model": str(export), "num_speculative_tokens": slots}
        target_dir = load_target(self.target, self.workdir).source
        llm = LLM(model=target_dir, speculative_config=speculative, disable_log_stats=False, enforce_eager=True)
        prompts = [[{"role": "user", "content": q}] for q in mtbench_questions(self.sizes.prompts)]
        llm.chat(prompts, SamplingParams(temperature=0, max_tokens=self.sizes.new_tokens), use_tqdm=False)
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        drafts = next((v for k, v in counters.items() if k.startswith("vllm:spec_decode_num_drafts")), None)
        accepted = next((v for k, v in counters.items() if k.startswith("vllm:spec_decode_num_accepted_tokens")), 0)
        metrics = client(self.workdir).get_run(run.run_id).data.metrics
        return {
            "vllm_accepted_length": 1 + accepted / drafts if drafts else None,
            "vllm_drafts": drafts,
            "evaluate_accepted_length": metrics.get(f"{EVAL_PREFIX}mtbench_measured_accepted_length_greedy"),
            "offline_realized_accepted_length": metrics.get(metric_key(REALIZED_ACCEPTED_LENGTH, VAL_PREFIX)),
        }

    def train_step_benchmark(self) -> dict:
        args = [
            sys.executable,
            "-m",
            "benchmarks.training.train_step",
            "--device",
            self.device,
            *self.sizes.train_step_benchmark,
        ]
        records = json_lines(command(args, 3600))
        if any("error" in r for r in records):
            raise AssertionError(f"a benchmark configuration failed: {records}")
        return {"records": records}

    def data_parallel(self) -> dict:
        """Scaling at the largest rank count available: every GPU of the machine (2 CPU ranks in the dry run)."""
        import torch

        ranks = torch.cuda.device_count() if self.device.startswith("cuda") else 2
        if ranks < 2:
            return {"not_measured": f"{ranks} CUDA device on this machine: data parallelism needs 2 or more"}
        args = [sys.executable, "-m", "benchmarks.training.train_step", "--device", self.device.partition(":")[0]]
        records = json_lines(command([*args, "--nproc-per-node", str(ranks), *self.sizes.data_parallel], 3600))
        if any("error" in r for r in records):
            raise AssertionError(f"a scaling leg failed: {records}")
        return {"records": [{k: v for k, v in r.items() if k != "legs"} for r in records]}

    def overhead(self) -> dict:
        args = [
            sys.executable,
            "-m",
            "benchmarks.training.overhead",
            "--device",
            self.device,
            "--workdir",
            str(self.workdir),
        ]
        out = self.workdir / "OVERHEAD.md"
        return {"records": json_lines(command([*args, *self.sizes.overhead, "--out", str(out)], 3600))}


@contextmanager
def counted_syncs() -> Iterator[list[warnings.WarningMessage]]:
    """The host syncs inside the block, one warning each, under `torch.cuda.set_sync_debug_mode("warn")`."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        syncs: list[warnings.WarningMessage] = []
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
            syncs += [w for w in caught if "synchroniz" in str(w.message)]


def sync_sites(syncs: list[warnings.WarningMessage]) -> dict[str, int]:
    """Where the syncs came from: file:line of the Python frame that triggered each, with counts."""
    sites: dict[str, int] = {}
    for warning in syncs:
        site = f"{Path(warning.filename).name}:{warning.lineno}"
        sites[site] = sites.get(site, 0) + 1
    return dict(sorted(sites.items(), key=lambda item: -item[1]))


def run_steps(steps: list[tuple[str, Callable[[], dict]]]) -> dict:
    """Every step, in order, each recorded as pass or fail with its figures or its error."""
    results = {}
    for name, step in steps:
        started = time.perf_counter()
        try:
            results[name] = {"status": "pass", **step()}
        except Exception as error:  # recorded, and the remaining steps still run
            results[name] = {"status": "fail", "error": f"{type(error).__name__}: {error}"}
        results[name]["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps({"step": name, **results[name]}, default=str)[:2000], flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (default: cuda)")
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help=f"caches and runs (default: {DEFAULT_WORKDIR})"
    )
    parser.add_argument(
        "--target-dir",
        type=Path,
        help=f"an already-converted Hugging Face target (default: the {EMBEDDED_TARGET} GGUF)",
    )
    parser.add_argument("--out", type=Path, help="the JSON summary (default: benchmarks/training/GPU_CHECK.json)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        args.device = "cpu"
    out = args.out or (
        args.workdir / "GPU_CHECK.json" if args.cpu_dry_run else Path(__file__).parent / "GPU_CHECK.json"
    )
    target = str(args.target_dir) if args.target_dir else EMBEDDED_TARGET
    check = Check(args.device, args.workdir, DRY if args.cpu_dry_run else REAL, target)
    started = time.perf_counter()
    steps = [
        ("prepare", check.prepare),
        ("train", check.train),
        ("evaluate", check.evaluate),
        ("export", check.export),
        ("syncs", check.syncs),
        ("vllm_serving", check.vllm_serving),
        ("train_step_benchmark", check.train_step_benchmark),
        ("data_parallel", check.data_parallel),
        ("overhead", check.overhead),
    ]
    results = run_steps(steps)
    summary = {
        "device": args.device,
        "dry_run": args.cpu_dry_run,
        "passed": all(r["status"] == "pass" for r in results.values()),
        "wall_s": round(time.perf_counter() - started, 1),
        "steps": results,
    }
    if args.device.startswith("cuda"):
        import torch

        summary["gpu"] = torch.cuda.get_device_name(args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"summary: {out} ({'passed' if summary['passed'] else 'FAILED'})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
