"""A real serving engine for the family: llama.cpp's `llama-server`, built by `scripts/llama_cpp.sh`.

The engine owns: finding the build, converting a target and a draft export to GGUF (f32, so both sides compute the
same target), and one server on loopback that is always stopped. What the served numbers are compared against
lives in `harness/served.py`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from harness.files import atomic_write

ENGINE = "llama.cpp"
# Where scripts/llama_cpp.sh builds: <cache>/llama.cpp/<commit>/{src,build,COMMIT}.
CACHE_ENV = "DFLASH_LAB_CACHE"
SETUP_COMMAND = "bash scripts/setup.sh"
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
# With LLAMA_TRACE set, the server logs every verify step: "... | task 3 | accepted  2/ 7 draft tokens".
CYCLE_LINE = re.compile(r"\| task (?P<task>\d+) \| accepted +(?P<accepted>\d+)/ *(?P<drafted>\d+) draft tokens")


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
    builds = [root for root in builds if (root / "build" / "bin" / "llama-server").is_file()]
    if not builds:
        raise EngineError(
            f"invalid --engine={ENGINE}: llama.cpp's llama-server is not built under {cache_root() / 'llama.cpp'}; "
            f"allowed after `{SETUP_COMMAND}` builds it (about 7 minutes on 2 cores, once)"
        )
    return Engine(builds[-1])


def to_gguf(engine: Engine, source: Path, out: Path, what: str, target_dir: Path | None = None) -> Path:
    """Convert a Hugging Face directory (a target, or a draft export with its target) to an f32 GGUF, once."""
    if out.is_file():
        return out
    command = [sys.executable, str(engine.converter), str(source), "--outtype", "f32"]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": str(engine.gguf_py)}

    def convert(tmp: Path) -> None:
        done = subprocess.run([*command, "--outfile", str(tmp)], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
            raise EngineError(f"converting {what} to GGUF failed: {lines[-1] if lines else done.returncode}")

    atomic_write(out, convert)
    return out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Completion:
    """One served request: its tokens, the accepted and drafted count of each verify step, tokens/s."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    tokens_per_s: float = float("nan")
    draft_n: int = 0
    draft_n_accepted: int = 0


class LlamaServer:
    """`llama-server` on loopback with a bounded start-up, stopped on leaving the block (Ctrl-C and SIGTERM
    included); with a draft it drafts the whole block and never cuts it by confidence."""

    def __init__(
        self,
        engine: Engine,
        model: Path,
        log_path: Path,
        draft: Path | None = None,
        draft_tokens: int = 0,
        spec_type: str = "draft-dflash",
        threads: int | None = None,
        port: int | None = None,
    ) -> None:
        self.engine, self.model, self.draft, self.log_path = engine, model, draft, log_path
        self.draft_tokens, self.spec_type = draft_tokens, spec_type
        self.threads = threads or max(1, os.cpu_count() or 1)
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        command = [str(self.engine.server), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["-np", "1", "-c", "4096", "-t", str(self.threads), "--no-webui"]
        if self.draft is not None:
            command += ["-md", str(self.draft), "--spec-type", self.spec_type]
            command += ["--spec-draft-n-max", str(self.draft_tokens), "--spec-draft-p-min", "0"]
        return command

    def __enter__(self) -> LlamaServer:
        for _ in range(3):  # a port another process took between the probe and the bind: another port
            self.port = self.port or free_port()
            try:
                self._start()
                return self
            except PortTaken:
                self.stop()
                self.port = None
            except BaseException:  # a failed or interrupted start leaves nothing running
                self.stop()
                raise
        raise EngineError(f"llama-server found no free port on 127.0.0.1 (log: {self.log_path})")

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            env = {**os.environ, "LLAMA_TRACE": "1"}  # one log line per verify step
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                if "bind" in tail and ("in use" in tail or "couldn't" in tail):
                    raise PortTaken
                raise EngineError(f"llama-server exited with status {self.process.returncode}: {tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise EngineError(f"llama-server did not answer within {START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def task_log(self, offset: int, timeout_s: float = 10.0) -> str:
        """The log written since `offset`, once the task's closing timing line is in it (the server logs from a
        thread of its own, so the lines may land just after the reply)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, errors="replace") as log:
                log.seek(offset)
                text = log.read()
            if "print_timing" in text or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    def log_tail(self, lines: int = 3) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def complete(self, prompt: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> Completion:
        """One request as token ids; sampling at T > 0 is plain temperature sampling (no top-k/top-p/min-p)."""
        offset = self.log_path.stat().st_size
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": temperature,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": seed,
            "cache_prompt": False,
            "return_tokens": True,
        }
        request = urllib.request.Request(
            f"{self.url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            reply = json.load(answer)
        cycles = list(CYCLE_LINE.finditer(self.task_log(offset)))
        timings = reply.get("timings", {})
        return Completion(
            tokens=list(reply.get("tokens", [])),
            accepted=[int(m["accepted"]) for m in cycles],
            drafted=[int(m["drafted"]) for m in cycles],
            tokens_per_s=float(timings.get("predicted_per_second", float("nan"))),
            draft_n=int(timings.get("draft_n", 0)),
            draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
        )


class PortTaken(Exception):
    """The server could not bind its port."""
