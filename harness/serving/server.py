"""One `llama-server` on loopback: started with a bounded wait, recorded while it runs, never outliving the process
that started it; and the session that binds the engine, the server records and a logs folder, so a call site
names only what differs (the model, the log's name, the drafter)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from harness.children import dying_with_this_process
from harness.files import atomic_write, process_alive, remove
from harness.run import server_records
from harness.serving.engine import SETUP_COMMAND, Engine, EngineError

if TYPE_CHECKING:
    from harness.serving.draft import ServedDraft

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
CONTEXT = 4096  # a server's context in tokens, shared by its slots
REQUEST_TIMEOUT_S = 600.0
# With LLAMA_TRACE set, the server logs every verify step: "... | task 3 | accepted  2/ 7 draft tokens".
CYCLE_LINE = re.compile(r"\| task (?P<task>\d+) \| accepted +(?P<accepted>\d+)/ *(?P<drafted>\d+) draft tokens")


def check_prompts_fit(prompt_sets: dict[str, list[list[int]]], n_predict: int, context: int = CONTEXT) -> None:
    """Refuse, before any server starts, a prompt that cannot fit a slot's context with its reply: the server would
    answer it only with `400 Bad Request`, its reason in its log."""
    room = context - n_predict
    for name, prompts in prompt_sets.items():
        for index, prompt in enumerate(prompts):
            if len(prompt) > room:
                raise EngineError(
                    f"invalid prompt {index} of set {name!r}: {len(prompt)} tokens, which with "
                    f"{n_predict} new tokens exceed the server's {context}-token context; allowed prompts of at most "
                    f"{room} tokens (shorten it, or ask for fewer new tokens)"
                )


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
    prompt_ms: float = float("nan")  # the prompt's evaluation: one batch of its tokens through the model


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): a pid that was reused by
    another process has another one. None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive_as(pid: int, started: str | None) -> bool:
    """Whether `pid` still runs as the process that was started at `started`."""
    if started is None or not sys.platform.startswith("linux"):
        return process_alive(pid)
    return start_time(pid) == started


def stop_orphans(records: Path) -> list[int]:
    """Stop every server recorded in `records` whose starting process no longer runs (a SIGKILL left it, on a
    system without parent-death signals or when the signal raced the start); returns their pids."""
    stopped = []
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except ValueError:
            remove(path)
            continue
        if alive_as(record["owner"], record.get("owner_started")):
            continue  # a live process of this work directory serves with it: not an orphan
        if alive_as(record["pid"], record.get("started")):
            log.warning(
                "stopping llama-server (pid %d, port %s) left running by process %d, which no longer runs",
                record["pid"],
                record.get("port"),
                record["owner"],
            )
            os.kill(record["pid"], signal.SIGKILL)
            stopped.append(record["pid"])
        remove(path)
    return stopped


def thread_budget() -> int:
    """The threads a server computes on: `OMP_NUM_THREADS` where the caller set one (pytest's workers and the
    commands they start take one each), else every core. llama.cpp's threads spin at each operation's barrier: two
    servers of two threads each on two cores decoded at 0.23 of one such server alone, two of one thread at 0.88
    (benchmarks/serving/THREADS.md)."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    return int(budget) if budget.isdigit() and int(budget) > 0 else max(1, os.cpu_count() or 1)


class LlamaServer:
    """`llama-server` on loopback with a bounded start-up, stopped on leaving the block (Ctrl-C and SIGTERM
    included) and killed by the kernel if the process that started it dies; with a draft it drafts the whole block
    and never cuts it by confidence.

    Each server is recorded in `records` (one file per server, under the work directory) while it runs, so a later
    start in the same work directory stops one that an earlier process left behind.
    """

    def __init__(
        self,
        engine: Engine,
        model: Path,
        log_path: Path,
        records: Path,
        draft: Path | None = None,
        draft_tokens: int = 0,
        spec_type: str | None = None,
        threads: int | None = None,
        port: int | None = None,
        synthetic_length: float | None = None,
        confidence_cut: float = 0.0,
        slots: int = 1,
        context: int = CONTEXT,
    ) -> None:
        self.engine, self.model, self.draft, self.log_path = engine, model, draft, log_path
        self.records = records
        # llama.cpp's --spec-synth-len: the real draft and verify run, the accept decision is drawn to reach this
        # mean accepted length (benchmarking only: the output is not the target's)
        self.synthetic_length = synthetic_length
        self.confidence_cut = confidence_cut  # --spec-draft-p-min (ServedDraft.confidence_cut)
        self.slots, self.context = slots, context  # parallel sequences (continuous batching), their total context
        self.draft_tokens, self.spec_type = draft_tokens, spec_type
        self.threads = threads or thread_budget()
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        command = [str(self.engine.server), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["-np", str(self.slots), "-c", str(self.context), "--no-webui"]
        # Every thread count spelled out: a default can fall to 1 on a two-vCPU machine
        command += ["-t", str(self.threads), "-tb", str(self.threads)]
        # No prompt cache in RAM (8 GiB by default): every request here is a new prompt, and a regeneration's
        # thousands of them grew the server to 7.5 GiB on a 24 GiB machine
        command += ["--cache-ram", "0"]
        if self.draft is not None:
            command += ["-md", str(self.draft), "-td", str(self.threads), "-tbd", str(self.threads)]
        if self.spec_type is not None:  # a draft model's type, or a training-free one (ngram-mod, ...) alone
            command += ["--spec-type", self.spec_type]
        if self.draft_tokens:
            command += ["--spec-draft-n-max", str(self.draft_tokens), "--spec-draft-p-min", f"{self.confidence_cut:g}"]
            if self.synthetic_length is not None:
                command += ["--spec-synth-len", f"{self.synthetic_length:g}"]
        return command

    @property
    def record_path(self) -> Path | None:
        return self.records / f"{self.process.pid}.json" if self.process is not None else None

    def __enter__(self) -> LlamaServer:
        stop_orphans(self.records)
        asked = self.port  # a port asked for is refused when taken, never moved
        if asked is not None:
            check_port_free(asked)
        for _ in range(1 if asked else 3):  # a chosen port another process took before the bind: another port
            self.port = asked or free_port()
            try:
                self._start()
                return self
            except PortTaken:
                self.stop()
                if asked:
                    raise EngineError(port_taken(asked)) from None
            except BaseException:  # a failed or interrupted start leaves nothing running
                self.stop()
                raise
        raise EngineError(f"llama-server found no free port on 127.0.0.1 (log: {self.log_path})")

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            env = {**os.environ, "LLAMA_TRACE": "1"}  # one log line per verify step
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=dying_with_this_process()
            )
        self._record()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                if "bind" in tail and ("in use" in tail or "couldn't" in tail):
                    raise PortTaken
                if self.process.returncode < 0:
                    number = -self.process.returncode
                    raise ServerKilled(self.died_at_start(number), signal_name(number))
                raise EngineError(f"llama-server exited with status {self.process.returncode}: {tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise EngineError(f"llama-server did not answer within {START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def died_at_start(self, number: int) -> str:
        """The line for a server killed by a signal while it loaded its model: the signal, and the remedy."""
        name = signal_name(number)
        if number == signal.SIGILL:
            remedy = (
                f"this engine build uses an instruction this CPU refuses (AMX or AVX-512 kernels, which only "
                f"quantized models reach); run `{SETUP_COMMAND}`: it tests the build on a quantized model and "
                f"rebuilds it without what fails"
            )
        else:
            remedy = f"its last lines: {self.log_tail()}"
        return f"llama-server was killed by {name} while loading {self.model.name}: {remedy} (log: {self.log_path})"

    def _record(self) -> None:
        record = {
            "pid": self.process.pid,
            "started": start_time(self.process.pid),
            "owner": os.getpid(),
            "owner_started": start_time(os.getpid()),
            "port": self.port,
            "log": str(self.log_path),
        }
        atomic_write(self.record_path, lambda tmp: tmp.write_text(json.dumps(record)))

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
        if self.process is not None:
            remove(self.record_path)
        self.process = None

    def died(self, error: BaseException) -> EngineError:
        """The one-line error for a request that failed: the server's exit and last log lines when it died (killed,
        crashed), or the request's own error when it still runs."""
        try:
            status = self.process.wait(timeout=5) if self.process is not None else None
        except subprocess.TimeoutExpired:
            status = None
        if status is None:
            return EngineError(f"llama-server at {self.url} failed a request ({error}); log: {self.log_path}")
        how = f"killed by signal {-status} ({signal_name(-status)})" if status < 0 else f"exited with status {status}"
        return EngineError(f"llama-server died during a request ({how}): {self.log_tail()} (log: {self.log_path})")

    def complete(
        self, prompt: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0, ignore_eos: bool = False
    ) -> Completion:
        """One request as token ids; sampling at T > 0 is plain temperature sampling (no top-k/top-p/min-p);
        `ignore_eos` decodes all `n_predict` tokens (a timing that does not depend on where the text ends)."""
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
            "ignore_eos": ignore_eos,
        }
        request = urllib.request.Request(
            f"{self.url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
                reply = json.load(answer)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
            raise self.died(error) from None
        cycles = list(CYCLE_LINE.finditer(self.task_log(offset)))
        timings = reply.get("timings", {})
        return Completion(
            tokens=list(reply.get("tokens", [])),
            accepted=[int(m["accepted"]) for m in cycles],
            drafted=[int(m["drafted"]) for m in cycles],
            tokens_per_s=float(timings.get("predicted_per_second", float("nan"))),
            prompt_ms=float(timings.get("prompt_ms", float("nan"))),
            draft_n=int(timings.get("draft_n", 0)),
            draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
        )


class PortTaken(Exception):
    """The server could not bind its port."""


class ServerKilled(EngineError):
    """The server was killed by a signal while it loaded its model (an instruction this CPU refuses, most often)."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.signal_name = signal_name


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def port_taken(port: int) -> str:
    return (
        f"invalid --port={port}: 127.0.0.1:{port} is already in use; allowed a free port (or no --port: one is chosen)"
    )


def check_port_free(port: int) -> None:
    """Refuse, in one line, a port asked for that is not one or that another process listens on."""
    if not 1 <= port <= 65535:
        raise EngineError(f"invalid --port={port}: allowed 1-65535")
    with socket.socket() as probe:
        # as the server binds: a port whose last connection is still in TIME_WAIT is free, a listened one is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise EngineError(port_taken(port)) from None


@dataclass(frozen=True)
class Session:
    """What every server of one serving job shares: the engine, the work directory's server records and the folder
    its logs go to. A server is then named by what differs: its model, its log's name, its drafter."""

    engine: Engine
    records: Path
    logs: Path

    @classmethod
    def of(cls, engine: Engine, workdir: Path, logs: Path) -> Session:
        return cls(engine, server_records(workdir), logs)

    def server(self, model: Path, name: str, draft: ServedDraft | None = None, **options) -> LlamaServer:
        """A server of `model` logging to `<logs>/<name>.log`, with the run's draft (or an n-gram `spec_type`)."""
        drafter = (draft.gguf, draft.block, draft.spec_type) if draft is not None else ()
        if draft is not None:
            options.setdefault("confidence_cut", draft.confidence_cut)
        return LlamaServer(self.engine, model, self.logs / f"{name}.log", self.records, *drafter, **options)


def complete_all(
    server: LlamaServer, prompts: dict[Any, list[list[int]]], n_predict: int, ignore_eos: bool = False, desc: str = ""
) -> dict[Any, list[Completion]]:
    """Every group's prompts at T = 0, one completion each, with a progress bar per group when `desc` is given."""
    return {
        key: [
            server.complete(p, n_predict, ignore_eos=ignore_eos)
            for p in tqdm(group, desc=f"{desc} {key}", unit="request", disable=not desc)
        ]
        for key, group in prompts.items()
    }
