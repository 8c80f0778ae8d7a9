"""Writes that a kill cannot leave half done: write beside the destination, then rename into place."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import logging
import os
import re
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
# `<name>.tmp<pid>` and `<name>.old<pid>`, as atomic_write names them.
TEMPORARY = re.compile(r"\.(tmp|old)(\d+)$")


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` creates a file or directory beside `path`; it then replaces `path` in one rename.

    An existing directory at `path` is moved aside first and removed only after the new one is in place.
    A failed or interrupted write leaves no temporary behind; a kill -9 leaves `<name>.tmp<pid>`, which the next
    write of `path` removes (a live writer's is kept).
    """
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    aside = path.with_name(f"{path.name}.old{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, of=path.name)
    remove(tmp)
    try:
        write(tmp)
        if path.is_dir() and not path.is_symlink():
            os.replace(path, aside)
        os.replace(tmp, path)
    except BaseException as error:
        # The writer's frames (held by the traceback) may keep the temporary open: on a full disk its blocks
        # would stay allocated after the unlink, and nothing else (SQLite recording the failure) could write.
        release_frames(error)
        raise
    finally:
        remove(tmp)
        remove(aside)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def release_frames(error: BaseException) -> None:
    """Clear the finished frames of `error` and of every exception chained to it, so the objects they held
    (open files, writers) are closed now rather than when the exception is finally dropped."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: Path, of: str | None = None) -> list[Path]:
    """Delete the temporaries that killed processes left in `directory` (only those of the file named `of`, when
    given); a live writer's are kept."""
    stale = [
        path
        for path in (sorted(directory.iterdir()) if directory.is_dir() else [])
        if (match := TEMPORARY.search(path.name))
        and (of is None or path.name[: match.start()] == of)
        and not process_alive(int(match.group(2)))
    ]
    for path in stale:
        log.info("removing %s, left by a process that no longer runs", path)
        remove(path)
    return stale


def check_writable(
    directory: Path, flag: str, what: str = "the work directory", store_files: tuple[str, ...] = (), hint: str = ""
) -> None:
    """Fail before any work when `directory` (or the folder that would hold it) or one of its existing
    `store_files` cannot be written. A real write is tried: a permission check alone misses read-only mounts."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    stores = [store for name in store_files if (store := Path(directory) / name).exists()]
    for path, probe in [(existing, _probe_directory), *((store, _probe_file) for store in stores)]:
        try:
            probe(path)
        except OSError as error:
            raise PermissionError(
                f"invalid {flag}={str(directory)!r}: {what} is not writable ({error.strerror or error}: {path}); "
                f"allowed a directory this user can write{hint}"
            ) from None


def _probe_directory(path: Path) -> None:
    if not path.is_dir():
        raise NotADirectoryError(20, "not a directory")
    tempfile.TemporaryFile(dir=path, prefix=".write-check").close()


def _probe_file(path: Path) -> None:
    open(path, "r+b").close()  # opened for writing, nothing written


@contextmanager
def file_lock(path: Path, waiting: str) -> Iterator[None]:
    """An exclusive flock on `path` (released by the OS when the holder dies); `waiting` is logged if it is busy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            log.info("%s: waiting for %s", waiting, holder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
