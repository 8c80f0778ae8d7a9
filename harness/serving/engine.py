"""Which llama.cpp build serves: the newest complete one that `scripts/llama_cpp.sh` left in the cache."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ENGINE = "llama.cpp"
# Where scripts/llama_cpp.sh builds: <cache>/llama.cpp/<commit>/{src,build,COMMIT}.
CACHE_ENV = "DFLASH_LAB_CACHE"
SETUP_COMMAND = "bash scripts/setup.sh"


class EngineError(RuntimeError):
    """The engine is missing, a conversion failed, or the server did not start: one line says which and why."""


@dataclass(frozen=True)
class Engine:
    root: Path  # <cache>/llama.cpp/<commit>

    @property
    def commit(self) -> str:
        return (self.root / "COMMIT").read_text().strip()

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def converter(self) -> Path:
        return self.root / "src" / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.root / "src" / "gguf-py"

    @property
    def converter_version(self) -> str:
        """The tree's gguf-py version: what wrote the GGUF files."""
        text = (self.gguf_py / "pyproject.toml").read_text()
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        return found.group(1) if found else "unknown"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-lab")


def find_engine() -> Engine:
    """The newest complete llama.cpp build in the cache."""
    builds = sorted(
        (root for root in (cache_root() / "llama.cpp").glob("*") if (root / "COMMIT").is_file()),
        key=lambda root: (root / "COMMIT").stat().st_mtime,
    )
    # The build script writes COMMIT only after the server linked: a build cut short has none and is not listed;
    # a server binary that lost its execute bit (or was replaced by something else) is refused below.
    if not builds:
        raise EngineError(
            f"invalid --engine={ENGINE}: llama.cpp's llama-server is not built under {cache_root() / 'llama.cpp'}; "
            f"allowed after `{SETUP_COMMAND}` builds it (about 7 minutes on 2 cores, once)"
        )
    engine = Engine(builds[-1])
    if not engine.server.is_file() or not os.access(engine.server, os.X_OK):
        state = "is not executable" if engine.server.is_file() else "is missing"
        raise EngineError(
            f"invalid --engine={ENGINE}: {engine.server} {state} (an interrupted or damaged build); "
            f"run `{SETUP_COMMAND}` to build it again"
        )
    return engine
