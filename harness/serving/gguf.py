"""GGUF files for the engine: a target or a draft export converted once (f32 unless told), stamped with its size
and checksum, and checked before every use."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.children import dying_with_this_process
from harness.files import atomic_write, file_lock, file_sha256, remove
from harness.run import SERVED_DIR
from harness.serving.engine import Engine, EngineError

if TYPE_CHECKING:
    from harness.targets import Target

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
STAMP_SUFFIX = ".sha256"  # beside each converted GGUF: its size and SHA-256 when it was written


def gguf_stamp(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def gguf_problem(path: Path) -> str | None:
    """Why a cached GGUF cannot be served (None when it can): no stamp (a kill between the rename and the stamp,
    or a file from elsewhere), another size (truncated), a header that is not GGUF (zeroed), or another checksum."""
    stamp_path = path.with_name(path.name + STAMP_SUFFIX)
    if not stamp_path.is_file():
        return "it has no checksum stamp"
    try:
        stamp = json.loads(stamp_path.read_text())
        size, sha256 = int(stamp["size"]), str(stamp["sha256"])
    except (ValueError, KeyError, TypeError):
        return "its checksum stamp is unreadable"
    if path.stat().st_size != size:
        return f"its size is {path.stat().st_size} bytes, {size} when written"
    with open(path, "rb") as file:
        if file.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            return "its header is not GGUF"
    if gguf_stamp(path)["sha256"] != sha256:
        return "its checksum differs from the one recorded when it was written"
    return None


def to_gguf(
    engine: Engine, source: Path, out: Path, what: str, target_dir: Path | None = None, outtype: str = "f32"
) -> Path:
    """Convert a Hugging Face directory (a target, or a draft export with its target) to a GGUF (f32 unless told:
    q8_0 and bf16 are the converter's other types), once.

    The conversion writes a temporary and renames it, then stamps the file with its size and checksum; a cached
    file is served only when its stamp checks out, and is rebuilt otherwise. A lock per file makes a second
    process wait for the first's conversion instead of reading it half-written or converting it twice.
    """
    stamp_path = out.with_name(out.name + STAMP_SUFFIX)
    with file_lock(out.with_name(out.name + ".lock"), f"converting {what} to GGUF"):
        if out.is_file():
            problem = gguf_problem(out)
            if problem is None:
                return out
            log.warning("rebuilding %s: %s", out, problem)
            remove(stamp_path)
            remove(out)
        command = [sys.executable, str(engine.converter), str(source), "--outtype", outtype]
        if target_dir is not None:
            command += ["--target-model-dir", str(target_dir)]
        env = {**os.environ, "PYTHONPATH": str(engine.gguf_py)}
        stamp: dict = {}

        def convert(tmp: Path) -> None:
            done = subprocess.run(
                [*command, "--outfile", str(tmp)],
                capture_output=True,
                text=True,
                env=env,
                preexec_fn=dying_with_this_process(),
            )
            if done.returncode != 0:
                cause = (
                    converter_error(done.stderr, done.stdout) or f"the converter exited with status {done.returncode}"
                )
                raise EngineError(f"converting {what} to GGUF in {out.parent} failed: {cause}")
            stamp.update(gguf_stamp(tmp))

        atomic_write(out, convert)
        atomic_write(stamp_path, lambda tmp: tmp.write_text(json.dumps(stamp)))
    return out


# A Python exception's closing line (`OSError: [Errno 28] No space left on device`), which the converter's progress
# bar may redraw after: its last line is then the bar, not the cause.
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b.*$")
PROGRESS_LINE = re.compile(r"\d+%\|")


def converter_error(stderr: str, stdout: str) -> str | None:
    """The line that says why a conversion failed: its last exception line, else its last line that is not a
    progress bar's (a bar redraws with carriage returns); None when it printed nothing."""
    lines = [line.strip() for text in (stderr, stdout) for line in re.split(r"[\r\n]+", text) if line.strip()]
    for line in reversed(lines):
        if EXCEPTION_LINE.match(line):
            return line
    words = [line for line in lines if not PROGRESS_LINE.search(line)]
    return words[-1] if words else None


def target_gguf(engine: Engine, workdir: Path, target: Target) -> Path:
    """The target as an f32 GGUF, converted once per work directory (keyed by its weights)."""
    out = workdir / SERVED_DIR / f"target-{target.weights_hash}-f32.gguf"
    return to_gguf(engine, Path(target.source), out, "the target")


D2T_TENSOR, HEAD_TENSOR = "d2t", "output.weight"
HEAD_SOURCES = (HEAD_TENSOR, "token_embd.weight")  # a target with tied embeddings keeps its head here
VIRTUAL_FIELDS = ("GGUF.", "general.architecture")  # written by GGUFWriter itself


def with_reduced_vocabulary(draft: Path, target: Path, token_ids: list[int], out: Path) -> Path:
    """A copy of the draft GGUF that drafts over `token_ids` only (FR-Spec's frequency-ranked head): its own
    `output.weight`, the target head's rows of those tokens, and the `d2t` map from each row to its target id,
    which llama.cpp reads to scatter the draft's logits back to the whole vocabulary. Everything else is the
    draft's, unchanged. The stock converter writes neither tensor."""
    import numpy as np
    from gguf import GGUFReader

    heads = {t.name: t for t in GGUFReader(target).tensors if t.name in HEAD_SOURCES}
    head = next((heads[name] for name in HEAD_SOURCES if name in heads), None)
    if head is None or head.tensor_type.name != "F32":
        raise EngineError(f"invalid target GGUF {target}: no f32 vocabulary head ({' or '.join(HEAD_SOURCES)})")
    rows = np.asarray(head.data)[np.asarray(token_ids)]  # numpy order: one row of n_embd per token
    added = {
        HEAD_TENSOR: np.ascontiguousarray(rows, dtype=np.float32),
        D2T_TENSOR: np.asarray(token_ids, dtype=np.int64),
    }

    def write(tmp: Path) -> None:
        copy_gguf(draft, tmp, drop=tuple(added), add=added)

    atomic_write(out, write)
    atomic_write(out.with_name(out.name + STAMP_SUFFIX), lambda tmp: tmp.write_text(json.dumps(gguf_stamp(out))))
    return out


def copy_gguf(source: Path, out: Path, drop: tuple[str, ...] = (), add: dict | None = None) -> None:
    """`source` rewritten to `out`: every metadata field and tensor as it is, less the tensors named in `drop`, plus
    the numpy arrays in `add` (by tensor name)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    writer = GGUFWriter(out, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith(VIRTUAL_FIELDS):
            continue
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    for tensor in reader.tensors:
        if tensor.name not in drop:
            shape = [int(n) for n in reversed(tensor.shape)]  # numpy order, as the writer takes it
            writer.add_tensor(tensor.name, tensor.data, raw_shape=shape, raw_dtype=tensor.tensor_type)
    for name, array in (add or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
