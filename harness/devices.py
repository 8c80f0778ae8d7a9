"""Where tensors live and how they are computed: the one place inputs reach a model's device, random
generators are made, and autocast is chosen. CPU and CUDA run the same code through these helpers.

Branches mean "an accelerator" (anything but the host CPU), not "CUDA": CI runs those paths on PyTorch's
`meta` device, which stands in for a GPU without one (tests/test_accelerator_standin.py)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from algorithms.blocks import Anchors, PackedRow, host_view


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator on `device`: sampling ops need theirs on the device of the tensors they sample."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def is_accelerator(device: torch.device | str) -> bool:
    """Anything but the host CPU: CUDA, or the `meta` stand-in."""
    return torch.device(device).type != "cpu"


class _NoRandomFill(torch.overrides.TorchFunctionMode):
    """Skips normal fills: torch runs `normal_` on `meta` through a Python reference whose first call imports
    torch._dynamo, about 2 s of a command's start-up for a fill that leaves no values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_:  # torch hands its arguments over by name
            return kwargs["tensor"]
        if func is torch.Tensor.normal_:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only():
    """Modules built inside have shapes, dtypes and parameter counts but no values: on `meta`, unfilled."""
    with torch.device("meta"), _NoRandomFill():
        yield


def model_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def anchors_to(anchors: Anchors, device: torch.device | str) -> Anchors:
    positions, valid = (t.to(device, non_blocking=True) for t in (anchors.positions, anchors.valid))
    return Anchors(positions, valid, anchors.host)


def to_device(row: PackedRow, anchors: Anchors, device: torch.device | str) -> tuple[PackedRow, Anchors]:
    """A row and its anchors, built on the host, on the model's device (one transfer per step). The anchors
    keep their host view, so the forward never reads anything back from the device."""
    anchors = Anchors(anchors.positions, anchors.valid, host_view(anchors, row.document_ids))
    return row.to(device), anchors_to(anchors, device)


def dtype_name(dtype: torch.dtype | str) -> str:
    """`bfloat16` for torch.bfloat16 (or a config's "bfloat16"): how caches, configs and plans spell a dtype."""
    return str(dtype).removeprefix("torch.")


def target_weights_dtype(device: torch.device | str) -> torch.dtype:
    """How a frozen target's weights load. bf16 on an accelerator: its features are computed under bf16 autocast
    there anyway, and fp32 weights would double a large target's memory. fp32 on the CPU, native bf16 or not:
    a CPU computes features in fp32 so that every CPU caches the same ones, and llama.cpp's f32 target, the
    served agreement's reference, decodes what an fp32 target decodes."""
    return torch.bfloat16 if is_accelerator(device) else torch.float32


def ids_on(ids: list[int], device: torch.device | str) -> torch.Tensor:
    """Token ids as a [1, T] batch on `device`."""
    return torch.tensor([ids], device=device)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queue: what a wall-clock timing on an accelerator needs (a no-op on the CPU, and
    on the stand-in, which has no queue)."""
    if is_accelerator(device) and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def autocast(device: str | torch.device, precision: str):
    """bf16 autocast with fp32 master weights, or fp32; `auto` is bf16 on an accelerator and on CPUs with
    native bf16.

    bf16 on CPU is about 2x faster where the CPU has native bf16 (AVX512-BF16/AMX), much slower elsewhere.
    """
    device_type = torch.device(device).type
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()  # the stand-in has no autocast: the one precision path it cannot run
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=uses_bf16(device, precision))


def uses_bf16(device: str | torch.device, precision: str) -> bool:
    """Whether `precision` on `device` computes in bf16 (`auto`: on an accelerator, and on a CPU with native
    bf16)."""
    if precision != "auto":
        return precision == "bf16"
    return is_accelerator(device) or cpu_has_native_bf16()


def computes_in(device: str | torch.device, precision: str) -> str:
    """`bf16` or `fp32`: the dtype `precision` computes in on `device`, as runs record and reports count it."""
    return "bf16" if uses_bf16(device, precision) else "fp32"


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 matmuls


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX-BF16 on this CPU (Linux flags; elsewhere False, so `auto` stays fp32)."""
    try:
        flags = next((line for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in CPU_BF16_FLAGS)


def check_device(text: str) -> None:
    """The device must exist on this machine: cpu, cuda or cuda:N."""
    if text == "cpu":
        return
    if not text.startswith("cuda") or (text != "cuda" and not text.removeprefix("cuda:").isdigit()):
        raise SystemExit(f"error: invalid --device={text!r}: allowed cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(text.removeprefix("cuda:")) if ":" in text else 0
    if index >= count:
        raise SystemExit(f"error: invalid --device={text!r}: allowed cpu (this machine has {count} CUDA devices)")
