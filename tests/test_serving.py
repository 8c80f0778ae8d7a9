"""The serving engine's refusals, each in one line with nothing left running, on a stand-in engine (scripts that
behave like llama.cpp's converter and server where it matters); the real engine's end-to-end test is in
tests/test_decode_e2e.py."""

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.serving import metrics as served_names
from harness.serving.engine import Engine, EngineError, find_engine
from harness.serving.gguf import STAMP_SUFFIX, gguf_problem, to_gguf
from harness.serving.server import LlamaServer, free_port, stop_orphans

from conftest import child_running, gone, one_line, tiny_draft

# A stand-in llama-server: answers /health on its port, or fails the way the real one does.
FAKE_SERVER = """\
#!{python}
import http.server, json, os, signal, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
# A CPU whose AMX (or AVX-512) instructions fault: a build that kept them dies loading a model, as a native build
# does on such a machine (BUILT_WITH, the build's compiler flags, is set by the stand-in cmake below).
faults = {{"amx": ["-mno-amx-tile"], "amx+avx512": ["-mno-amx-tile", "-mno-avx512f"]}}
needed = faults.get(os.environ.get("FAKE_CPU_FAULTS", ""), [])
if any(flag not in globals().get("BUILT_WITH", "") for flag in needed):
    os.kill(os.getpid(), signal.SIGILL)
if os.environ.get("FAKE_MODE") == "broken":
    print("llama_model_load: error loading model: tensor 'output.weight' not found", flush=True)
    print("main: exiting due to model loading error", flush=True)
    sys.exit(1)
if str(port) == os.environ.get("FAKE_BUSY_PORT"):
    print(f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {{port}}", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{"status": "ok"}}')
    def do_POST(self):  # a request: FAKE_MODE=crash dies in it as a crashed server would
        if os.environ.get("FAKE_MODE") == "crash":
            print("GGML_ASSERT(n_tokens > 0) failed", flush=True)
            os._exit(134)
        # A known truth for the break-even: a cycle costs 3.5 plain tokens, so tokens/s = 100 L / 3.5 at
        # synthetic accepted length L (an integer here: every cycle accepts L - 1), and 100 without a draft; the
        # prompt's length moves each request's speed by a percent either way.
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        speed = 100.0 * (1 + 0.01 * (len(prompt) % 3 - 1))
        if "--spec-synth-len" in args:
            length = float(args[args.index("--spec-synth-len") + 1])
            for _ in range(4):
                print(f"slot | task 0 | accepted  {{int(length) - 1}}/ 7 draft tokens", flush=True)
            speed *= length / 3.5
        print("slot print_timing: id  0 | task 0 |", flush=True)
        reply = {{"tokens": [1] * body["n_predict"], "timings": {{"predicted_per_second": speed}}}}
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(reply).encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# A stand-in converter: fails as the real one does without --target-model-dir; with FAKE_CONVERT=ok writes a small
# GGUF (counting its conversions in FAKE_CONVERT_COUNT), with FAKE_CONVERT=full runs out of disk half way.
FAKE_CONVERTER = """\
import os, sys, time
args = sys.argv[1:]
mode = os.environ.get("FAKE_CONVERT")
if mode == "ok":
    with open(os.environ["FAKE_CONVERT_COUNT"], "a") as count:
        count.write("converted\\n")
    time.sleep(float(os.environ.get("FAKE_CONVERT_SECONDS", "0")))
    with open(args[args.index("--outfile") + 1], "wb") as out:
        out.write(b"GGUF" + bytes(range(256)) * 64)
    sys.exit(0)
if mode == "full":  # as the real converter ends on a full disk: its bar is redrawn after the traceback
    print("INFO:hf-to-gguf:Model successfully exported", flush=True)
    with open(args[args.index("--outfile") + 1], "wb") as out:
        out.write(b"GGUF" + bytes(1000))
    print("Writing:  12%|#2        | 64.0M/540M [00:01<00:07]\\r", end="", file=sys.stderr)
    print("Traceback (most recent call last):", file=sys.stderr)
    print("OSError: [Errno 28] No space left on device", file=sys.stderr)
    print("Writing:  76%|#######6  | 412M/540M [00:03<00:01]\\r", end="", file=sys.stderr)
    sys.exit(1)
print("INFO:hf-to-gguf:Loading model: draft", file=sys.stderr)
print("ValueError: DFlash draft model requires --target-model-dir to be specified.", file=sys.stderr)
sys.exit(1)
"""


@pytest.fixture
def engine(tmp_path, monkeypatch) -> Engine:
    root = tmp_path / "cache" / "llama.cpp" / "0c1e57098"
    (root / "build" / "bin").mkdir(parents=True)
    (root / "src" / "gguf-py").mkdir(parents=True)
    server = root / "build" / "bin" / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    (root / "src" / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    (root / "src" / "gguf-py" / "pyproject.toml").write_text('[tool.poetry]\nversion = "0.18.0"\n')
    (root / "COMMIT").write_text("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n")
    monkeypatch.setenv("DFLASH_LAB_CACHE", str(tmp_path / "cache"))
    return find_engine()


def test_an_engine_not_built_names_the_setup_command(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LAB_CACHE", str(tmp_path / "empty"))
    result = cli(["evaluate", "some-run", "--engine", "llama.cpp", "--workdir", str(tmp_path / "work")])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "llama-server is not built" in lines[0] and "bash scripts/setup.sh" in lines[0]


def test_the_built_engine_is_found_with_its_commit_and_converter_version(engine):
    assert engine.commit.startswith("0c1e57098") and engine.converter_version == "0.18.0"


def test_a_failed_conversion_names_what_and_the_converters_last_line(engine, tmp_path):
    with pytest.raises(EngineError) as failed:
        to_gguf(engine, tmp_path, tmp_path / "draft.gguf", "run my-run")
    assert str(failed.value) == (
        f"converting run my-run to GGUF in {tmp_path} failed: "
        "ValueError: DFlash draft model requires --target-model-dir to be specified."
    )
    assert [p.name for p in tmp_path.glob("draft.gguf*")] == ["draft.gguf.lock"], "no half-written GGUF is left"


def test_a_server_that_does_not_start_gives_its_last_log_lines_and_leaves_nothing_running(
    engine, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_MODE", "broken")
    server = LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", tmp_path / "servers")
    with pytest.raises(EngineError, match=r"exited with status 1: .*error loading model.*exiting due to model"), server:
        pass
    assert server.process is None


def test_a_chosen_port_taken_before_the_bind_moves_to_another(engine, tmp_path, monkeypatch):
    import harness.serving.server

    busy, spare = free_port(), free_port()
    monkeypatch.setenv("FAKE_BUSY_PORT", str(busy))
    chosen = iter([busy, spare])
    monkeypatch.setattr(harness.serving.server, "free_port", lambda: next(chosen))
    with LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", tmp_path / "servers") as server:
        assert server.port == spare and server.process.poll() is None
        process = server.process
    assert process.poll() is not None, "the server is stopped on leaving the block"


def test_a_port_asked_for_and_taken_is_refused_never_moved(engine, tmp_path, cli):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        server = LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", tmp_path / "servers", port=busy)
        with pytest.raises(EngineError) as failed, server:
            pass
        expected = f"invalid --port={busy}: 127.0.0.1:{busy} is already in use; allowed a free port"
        assert str(failed.value).startswith(expected) and server.process is None
        # the command refuses it before it looks for the run or loads anything
        line = one_line(cli(["serve", "no-such-run", "--port", str(busy), "--workdir", str(tmp_path / "work")]))
        assert line.startswith(f"error: {expected}")
    assert "allowed 1-65535" in one_line(cli(["serve", "x", "--port", "70000", "--workdir", str(tmp_path)]))


def test_a_member_without_an_export_format_is_refused_in_one_line():
    from harness.serving.draft import check_servable

    with pytest.raises(EngineError, match=r"invalid --engine=llama.cpp for run of domino: cannot export a domino"):
        check_servable(tiny_draft("domino"))


def test_a_selector_lattice_wider_than_the_hidden_size_is_refused():
    """llama.cpp's DFlash2 lattice holds K + K*K scores per row in the hidden width: K(K + 1) <= hidden."""
    from harness.serving.draft import check_servable

    check_servable(tiny_draft("dflash2", candidate_top_k=7))  # 56 <= 64
    with pytest.raises(EngineError, match=r"top_k \* \(top_k \+ 1\) = 72 in llama.cpp, the target has 64; allowed "):
        check_servable(tiny_draft("dflash2", candidate_top_k=8))


def test_served_cycles_are_compared_only_where_both_drafted_the_whole_block():
    from harness.serving.compare import compare_cycles
    from harness.serving.server import Completion

    served = Completion(tokens=[], accepted=[0, 2, 1, 0], drafted=[7, 7, 7, 3])
    assert compare_cycles([0, 2, 1, 1], [7, 7, 7, 2], served, 7)[:2] == (3, 3)  # the budget-cut last is left out
    compared, identical, divergence = compare_cycles([0, 3, 1], [7, 7, 7], served, 7)
    assert (compared, identical) == (2, 1) and (divergence.cycle, divergence.harness_accepted) == (1, 3)


def test_the_served_log_line_pattern_reads_the_real_servers_lines():
    from harness.serving.server import CYCLE_LINE

    line = "0.24.561.702 I slot   operator(): id  0 | task 12 | accepted  3/ 7 draft tokens"
    found = CYCLE_LINE.search(line)
    assert (found["task"], found["accepted"], found["drafted"]) == ("12", "3", "7")


@pytest.mark.parametrize(
    ("budget", "threads"), [("1", 1), ("3", 3), ("", os.cpu_count() or 1), ("zero", os.cpu_count() or 1)]
)
def test_a_server_computes_on_the_callers_thread_budget_and_names_every_thread_count(budget, threads, monkeypatch):
    """Two servers of two spinning threads on two cores decoded 4x slower (benchmarks/serving/THREADS.md), so
    `OMP_NUM_THREADS` caps a server's threads; the target's and the draft's batch counts are spelled out too."""
    monkeypatch.setenv("OMP_NUM_THREADS", budget)
    engine = Engine(root=Path("llama.cpp"))
    command = LlamaServer(engine, Path("t.gguf"), Path("log"), Path("records"), draft=Path("d.gguf")).command()
    flags = {flag: command[command.index(flag) + 1] for flag in ("-t", "-tb", "-td", "-tbd")}
    assert flags == dict.fromkeys(flags, str(threads))
    alone = LlamaServer(engine, Path("t.gguf"), Path("log"), Path("records")).command()
    assert "-td" not in alone and alone[alone.index("-tb") + 1] == str(threads)


def test_a_drafts_confidence_cut_reaches_the_server_and_is_off_unless_asked():
    """ServedDraft.confidence_cut is llama.cpp's --spec-draft-p-min (0 otherwise: every cycle drafts its block)."""
    from harness.serving.draft import ServedDraft
    from harness.serving.server import Session

    session = Session(Engine(root=Path("llama.cpp")), Path("records"), Path("logs"))
    draft = ServedDraft("run", "dflash2", Path("d.gguf"), 3, "draft-dflash", 1)
    for served, expected in ((draft, "0"), (dataclasses.replace(draft, confidence_cut=0.35), "0.35")):
        command = session.server(Path("t.gguf"), "s", served).command()
        assert command[command.index("--spec-draft-p-min") + 1] == expected
        assert command[command.index("--spec-draft-n-max") + 1] == "3"


# ---- the served path under kills and bad files (docs/faults.md, "The serving engine") ----------------------


STARTS_A_SERVER = """\
import sys, time
from pathlib import Path
from harness.serving.engine import find_engine
from harness.serving.server import LlamaServer
work = Path(sys.argv[1])
server = LlamaServer(find_engine(), work / "model.gguf", work / "server.log", work / "servers")
server.__enter__()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_a_server_dies_with_the_process_that_started_it_even_under_sigkill(engine, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTS_A_SERVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    server_pid = int(parent.stdout.readline())
    assert not gone(server_pid, within_s=0.5)
    parent.kill()
    parent.wait()
    assert gone(server_pid), "the kernel's parent-death signal ends the server with its parent"


def test_a_later_start_stops_a_server_that_a_dead_process_left_and_keeps_a_live_ones(engine, tmp_path):
    """Where the parent-death signal did not fire (another OS, a start that raced the parent's death), the record
    in the work directory lets the next start find the orphan and stop it."""
    records = tmp_path / "servers"
    records.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.Popen([str(engine.server), "--port", str(free_port())], start_new_session=True)
    kept = subprocess.Popen([str(engine.server), "--port", str(free_port())], start_new_session=True)
    try:
        (records / f"{orphan.pid}.json").write_text(json.dumps({"pid": orphan.pid, "owner": dead.pid, "port": 1}))
        (records / f"{kept.pid}.json").write_text(json.dumps({"pid": kept.pid, "owner": os.getpid(), "port": 2}))
        with LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", records) as server:
            assert orphan.wait(timeout=10) == -signal.SIGKILL, "the orphan is stopped"
            assert kept.poll() is None, "a server whose process still runs is not an orphan"
            assert sorted(p.name for p in records.iterdir()) == sorted(
                [f"{kept.pid}.json", f"{server.process.pid}.json"]
            )
        assert sorted(p.name for p in records.iterdir()) == [f"{kept.pid}.json"], "a stopped server's record goes"
        assert stop_orphans(records) == []
    finally:
        for process in (orphan, kept):
            process.kill()
            process.wait()


def test_a_server_that_dies_mid_request_ends_in_one_line_with_its_last_log_lines(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "crash")
    server = LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", tmp_path / "servers")
    with server, pytest.raises(EngineError) as died:
        server.complete([1, 2, 3], 8)
    message = str(died.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("llama-server died during a request (exited with status 134): ")
    assert "GGML_ASSERT(n_tokens > 0) failed" in message and str(tmp_path / "server.log") in message
    assert server.process is None and not list((tmp_path / "servers").iterdir())


def test_a_non_executable_or_missing_server_names_the_setup_command(engine, cli, tmp_path):
    engine.server.chmod(0o644)
    result = cli(["evaluate", "some-run", "--engine", "llama.cpp", "--workdir", str(tmp_path / "work")])
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "llama-server is not executable" in line and "bash scripts/setup.sh" in line
    engine.server.unlink()
    result = cli(["evaluate", "some-run", "--engine", "llama.cpp", "--workdir", str(tmp_path / "work")])
    (line,) = result.stderr.strip().splitlines()
    assert "llama-server is missing" in line and "bash scripts/setup.sh" in line


def test_a_build_without_its_commit_stamp_is_not_a_build(engine):
    """scripts/llama_cpp.sh writes COMMIT last: a build cut short (Ctrl-C, a kill) is never found as complete."""
    (engine.root / "COMMIT").unlink()
    with pytest.raises(EngineError, match="llama-server is not built under .* allowed after `bash scripts/setup.sh`"):
        find_engine()


def test_the_build_script_redoes_a_build_that_did_not_finish(engine, tmp_path):
    """A server binary without the COMMIT stamp (a build killed while linking) makes the script build again; here
    the source it is given fails its hash check, which shows it did not take the half build as done."""
    (engine.root / "COMMIT").unlink()
    bogus = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    bogus.write_bytes(b"not the sdist")
    root = Path(__file__).parent.parent
    env = {**os.environ, "DFLASH_LAB_CACHE": str(engine.root.parent.parent), "LLAMA_CPP_SDIST": str(bogus)}
    done = subprocess.run(["bash", "scripts/llama_cpp.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "did not finish (no COMMIT stamp): building it again" in done.stdout
    assert f"{bogus} is not the llama-cpp-python 0.3.36 sdist (SHA-256 differs)" in done.stderr
    assert not engine.server.exists(), "the half build's binary is never left to be found"


@pytest.fixture
def converting(engine, tmp_path, monkeypatch) -> Path:
    """FAKE_CONVERT=ok; returns the file that counts the conversions."""
    count = tmp_path / "conversions"
    monkeypatch.setenv("FAKE_CONVERT", "ok")
    monkeypatch.setenv("FAKE_CONVERT_COUNT", str(count))
    return count


def conversions(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda path: path.write_bytes(path.read_bytes()[:100]), "its size is 100 bytes"),
        (lambda path: path.write_bytes(bytes(path.stat().st_size)), "its header is not GGUF"),
        (lambda path: path.write_bytes(path.read_bytes()[:-1] + b"x"), "its checksum differs"),
        (lambda path: path.with_name(path.name + STAMP_SUFFIX).unlink(), "it has no checksum stamp"),
    ],
    ids=["truncated", "zeroed", "changed", "unstamped"],
)
def test_a_damaged_cached_gguf_is_detected_and_rebuilt_never_served(engine, converting, tmp_path, damage, problem):
    out = tmp_path / "served" / "target-f32.gguf"
    to_gguf(engine, tmp_path, out, "the target")
    assert gguf_problem(out) is None and conversions(converting) == 1
    to_gguf(engine, tmp_path, out, "the target")
    assert conversions(converting) == 1, "a sound cached file is used as it is"
    damage(out)
    assert problem in gguf_problem(out)
    to_gguf(engine, tmp_path, out, "the target")
    assert conversions(converting) == 2 and gguf_problem(out) is None


def test_two_processes_converting_one_file_convert_it_once_and_never_read_it_half_written(
    engine, converting, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_CONVERT_SECONDS", "1")
    out = tmp_path / "served" / "target-f32.gguf"
    sizes = []

    def convert() -> None:
        sizes.append(to_gguf(engine, tmp_path, out, "the target").stat().st_size)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert conversions(converting) == 1 and len(set(sizes)) == 1 and sizes[0] == out.stat().st_size
    assert gguf_problem(out) is None


def test_a_disk_that_fills_during_conversion_leaves_no_file_to_reuse(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CONVERT", "full")
    out = tmp_path / "served" / "draft-f32.gguf"
    with pytest.raises(EngineError) as failed:
        to_gguf(engine, tmp_path, out, "run my-run")
    assert str(failed.value) == (
        f"converting run my-run to GGUF in {out.parent} failed: OSError: [Errno 28] No space left on device"
    ), "the converter's error, not its progress bar redrawn after it"
    assert sorted(p.name for p in out.parent.iterdir()) == ["draft-f32.gguf.lock"], "no partial GGUF, no stamp"


def test_a_conversion_removes_a_dead_writers_temporary_and_keeps_a_live_ones(engine, converting, tmp_path):
    out = tmp_path / "served" / "target-f32.gguf"
    out.parent.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        stale_file, stale_dir = out.with_name(f"{out.name}.tmp{dead.pid}"), out.with_name(f"{out.name}.old{dead.pid}")
        kept = out.with_name(f"{out.name}.tmp{live.pid}")
        other = out.with_name(f"draft-f32.gguf.tmp{dead.pid}")  # another file's: its own next write removes it
        for path in (stale_file, kept, other):
            path.write_bytes(b"GGUF half")
        stale_dir.mkdir()
        to_gguf(engine, tmp_path, out, "the target")
        assert not stale_file.exists() and not stale_dir.exists(), "a killed writer's temporaries are removed"
        assert kept.exists(), "a live writer's temporary is never touched"
        assert other.exists()
    finally:
        live.kill()
        live.wait()


def test_a_killed_conversion_leaves_no_converter_running(engine, converting, tmp_path, monkeypatch):
    """The converter is started with the parent-death signal, as the server is: SIGKILL of the process converting
    ends it too, instead of leaving it to load (minutes, for a real target) and write on its own."""
    monkeypatch.setenv("FAKE_CONVERT_SECONDS", "60")
    code = (
        "import sys; from pathlib import Path; from harness.serving.engine import find_engine; "
        "from harness.serving.gguf import to_gguf; "
        "to_gguf(find_engine(), Path(sys.argv[1]), Path(sys.argv[1]) / 'served' / 'target-f32.gguf', 'the target')"
    )
    converting_process = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        converter = child_running(converting_process.pid, "convert_hf_to_gguf.py")
    finally:
        converting_process.kill()
        converting_process.wait()
    assert gone(converter.pid, within_s=2), "the converter outlived the process that started it"


def test_a_server_killed_by_sigill_while_loading_names_the_signal_and_the_setup(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CPU_FAULTS", "amx")
    server = LlamaServer(engine, tmp_path / "model.Q4_1.gguf", tmp_path / "server.log", tmp_path / "servers")
    with pytest.raises(EngineError) as failed, server:
        pass
    message = str(failed.value)
    assert message.startswith("llama-server was killed by SIGILL while loading model.Q4_1.gguf: ")
    assert "run `bash scripts/setup.sh`" in message and "rebuilds it without what fails" in message
    assert server.process is None


# A stand-in cmake: configuring records the compiler flags; building writes the stand-in server with them
# (BUILT_WITH) and appends them to FAKE_BUILDS.
FAKE_CMAKE = """\
#!{python}
import os, sys
from pathlib import Path
args = sys.argv[1:]
if args[0] == "--build":
    build = Path(args[1])
    flags = (build / "flags").read_text()
    (build / "bin").mkdir(parents=True, exist_ok=True)
    server = build / "bin" / "llama-server"
    shebang, body = Path(os.environ["FAKE_SERVER_TEMPLATE"]).read_text().split("\\n", 1)
    server.write_text(f"{{shebang}}\\nBUILT_WITH = {{flags!r}}\\n{{body}}")
    server.chmod(0o755)
    with open(os.environ["FAKE_BUILDS"], "a") as builds:
        builds.write(flags + "\\n")
else:
    build = Path(args[args.index("-B") + 1])
    build.mkdir(parents=True, exist_ok=True)
    (build / "flags").write_text(next(a.split("=", 1)[1] for a in args if a.startswith("-DCMAKE_C_FLAGS=")))
"""
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def test_setup_rebuilds_an_engine_that_dies_on_a_quantized_model_without_the_instruction_set_that_failed(
    engine, tmp_path
):
    """On a CPU whose AMX faults (as a 2-core Xeon's did: SIGILL at its first tile instruction, on every quantized
    target) the native build fails the setup's proof and is rebuilt without AMX, which then serves; the choice
    is recorded beside the COMMIT stamp and the cached build is reused. A cached build that fails the proof later
    (here: AVX-512 faults too) is rebuilt, not reused."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in [("cmake", FAKE_CMAKE.format(python=sys.executable)), ("ninja", "#!/bin/sh\nexit 1\n")]:
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    template = tmp_path / "server-template"
    template.write_text(FAKE_SERVER.format(python=sys.executable))
    builds = tmp_path / "builds"
    script = Path(__file__).parent.parent / "scripts" / "llama_cpp.sh"
    sdist_sha256 = re.search(r"^SDIST_SHA256=(\w+)", script.read_text(), re.M).group(1)
    (engine.root / "src" / ".sdist-sha256").write_text(sdist_sha256 + "\n")  # the source is there: no download
    (engine.root / "COMMIT").unlink()  # a fresh setup

    def setup(faults: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PATH": f"{tools}:{os.environ['PATH']}",
            "DFLASH_LAB_CACHE": str(engine.root.parent.parent),
            "FAKE_SERVER_TEMPLATE": str(template),
            "FAKE_BUILDS": str(builds),
            "FAKE_CPU_FAULTS": faults,
        }
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    first = setup("amx")
    assert "llama-server died by SIGILL serving a quantized model; rebuilding without AMX" in first.stdout
    assert "llama-server built without AMX" in first.stdout
    assert builds.read_text().splitlines() == ["", NO_AMX]
    assert (engine.root / "CPU_FLAGS").read_text().splitlines() == [NO_AMX, "left out: AMX"]
    assert find_engine().commit.startswith("0c1e57098")

    again = setup("amx")
    assert "llama-server found (cached)" in again.stdout and len(builds.read_text().splitlines()) == 2

    moved = setup("amx+avx512")  # the cached build now fails its proof
    assert "rebuilding without AMX and AVX-512" in moved.stdout
    assert builds.read_text().splitlines()[-1] == f"{NO_AMX} -mno-avx512f"
    assert (engine.root / "CPU_FLAGS").read_text().splitlines()[1] == "left out: AMX and AVX-512"


# ---- the break-even (harness/serving/break_even.py) ------------------------------------------------------


def test_the_crossing_is_read_by_linear_interpolation_between_measured_lengths():
    from harness.serving.break_even import crossing, synthetic_lengths

    assert crossing([1, 3, 5], [0.3, 0.8, 1.2]) == pytest.approx(3 + 0.2 / 0.4 * 2)  # 4.0
    assert crossing([1, 3, 5], [0.3, 0.8, 0.9]) == float("inf"), "never reached within the block"
    assert crossing([1, 3], [1.1, 2.0]) == 1, "pays for itself at any length"
    assert math.isnan(crossing([1, 3], [math.nan, math.nan])), "an unknown bound is unknown, not never reached"
    assert synthetic_lengths(7) == (1.0, 4.5, 8.0) and synthetic_lengths(4, count=5) == (1, 2, 3, 4, 5)


def test_the_break_even_of_a_stand_in_engine_with_a_known_cycle_cost_is_that_cost(engine, tmp_path):
    """The stand-in's cycle costs 3.5 plain tokens at every length: speed-up L / 3.5, break-even 3.5, and the
    interval over prompts holds it."""
    from harness.serving.break_even import measure
    from harness.serving.draft import ServedDraft
    from harness.serving.server import Session

    prompts = [[1] * n for n in (3, 4, 5, 6, 7, 8)]
    session = Session(engine, tmp_path / "servers", tmp_path)
    draft = ServedDraft("d", "dflash2", tmp_path / "d.gguf", 7, "draft-dflash", 1)
    found = measure(session, tmp_path / "t.gguf", draft, prompts, 8, lengths=(1, 3, 5, 8))
    assert [p.accepted_length for p in found.points] == [1, 3, 5, 8]
    assert [p.speedup.value for p in found.points] == pytest.approx([1 / 3.5, 3 / 3.5, 5 / 3.5, 8 / 3.5])
    assert found.length == pytest.approx(3.5) and found.low <= 3.5 <= found.high
    assert found.cycle_cost == pytest.approx(3.5) and found.alone_tokens_per_s == pytest.approx(100)
    metrics = found.metrics()
    assert metrics["break_even_accepted_length"] == found.length and metrics["synthetic_8_speedup"] > 2
    assert found.text().startswith("3.50 [")
    alone = measure(session, tmp_path / "t.gguf", draft, prompts[:1], 8, lengths=(1, 3, 5, 8))
    assert alone.length == pytest.approx(3.5) and math.isnan(alone.low) and math.isnan(alone.high)
    assert alone.text() == "3.50 (no interval: one prompt)"  # not a crossing that never comes


def test_the_served_verdict_line_states_the_break_even_with_its_interval_or_says_it_has_none():
    from harness.cli import served_verdict
    from harness.serving import metrics as names

    metrics = {names.ACCEPTED_GREEDY: 1.3, names.BREAK_EVEN: 1.9, names.CYCLE_COST: 1.8}
    bounded = {**metrics, names.low(names.BREAK_EVEN): 1.8, names.high(names.BREAK_EVEN): math.inf}
    assert "break-even on this machine 1.90 [1.80, not reached]: 0.60 accepted tokens" in served_verdict(bounded)
    unknown = {**metrics, names.low(names.BREAK_EVEN): math.nan, names.high(names.BREAK_EVEN): math.nan}
    assert "break-even on this machine 1.90 (no interval: one prompt)" in served_verdict(unknown)


HOLDS_A_LOCK = """\
import sys, time
from pathlib import Path
from harness.files import file_lock
with file_lock(Path(sys.argv[1]), "serving run r"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_process_waits_for_the_runs_serving_lock_and_says_whom_it_waits_for(tmp_path, caplog):
    """Two evaluations of one run: the second waits until the first has served, then serves itself."""
    from harness.files import file_lock

    lock = tmp_path / "served" / ".serving.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_A_LOCK, str(lock), "1.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with caplog.at_level("INFO", logger="harness.files"), file_lock(lock, "serving run r"):
        waited = time.monotonic() - started
    holder.wait()
    assert waited > 1.0, "the lock was taken only after the first process let it go (it held it 1.5 s)"
    assert f"serving run r: waiting for process {holder.pid}" in caplog.text


@pytest.mark.parametrize(
    "stop, status, reason",
    [
        (EngineError("llama-server died during a request (killed by signal 9): ..."), "failed", "llama-server died"),
        (KeyboardInterrupt(), "interrupted", "interrupted (Ctrl-C)"),
    ],
    ids=["server-died", "ctrl-c"],
)
def test_a_serving_that_stops_early_is_recorded_with_its_reason_never_left_running(
    tmp_path, monkeypatch, stop, status, reason
):
    """The run's served state reads running only while it serves; a stop records failed or interrupted, and
    nothing served is logged."""
    import mlflow

    from harness import tracking
    from harness.run import Run
    from harness.serving.compare import served_status, serving
    from harness.tracking import RunStatus

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = Run(tmp_path, "served-run", experiment="serving-check")
    with run.active({}):
        pass
    with pytest.raises(type(stop)), serving(run):
        assert served_status(run) is RunStatus.RUNNING
        raise stop
    tags = run.tags()
    assert tags[tracking.TAG_SERVED_STATUS] == status and tags[tracking.TAG_SERVED_REASON].startswith(reason)
    assert not tracking.client(tmp_path).get_run(run.run_id).data.metrics
    mlflow.set_tracking_uri("")


def test_more_metrics_than_one_mlflow_batch_holds_land_once_each_with_the_tags_last(tmp_path, monkeypatch):
    """2,500 metrics go in three batches of at most 1,000 (MLflow's limit), the tags with the last one."""
    import mlflow

    from harness import tracking
    from harness.run import Run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = Run(tmp_path, "many-metrics", experiment="batch-check")
    with run.active({}):
        pass
    batches = []
    client = tracking.client(tmp_path)
    original = type(client).log_batch
    monkeypatch.setattr(
        type(client),
        "log_batch",
        lambda self, run_id, metrics=(), tags=(), **kw: (
            batches.append((len(metrics), len(tags))) or original(self, run_id, metrics=metrics, tags=tags, **kw)
        ),
    )
    run.log_into_finished({f"m{i}": float(i) for i in range(2500)}, "x/", [], tags={"t": "done"})
    assert batches == [(1000, 0), (1000, 0), (500, 1)]
    logged = tracking.client(tmp_path).get_run(run.run_id).data
    assert len([k for k in logged.metrics if k.startswith("x/")]) == 2500 and logged.tags["t"] == "done"
    assert len(tracking.client(tmp_path).get_metric_history(run.run_id, "x/m7")) == 1
    mlflow.set_tracking_uri("")


def test_each_request_is_timed_alone_before_and_after_the_draft_and_the_speed_up_has_an_interval(tmp_path):
    """A machine that slows down while it serves: alone runs 100 then 80 tokens/s around the draft's 120, so the
    paired baseline is 90, not the 80 a pass after the draft alone would give (a flattering 1.5x)."""
    from types import SimpleNamespace
    from unittest import mock

    from harness.serving import compare as served
    from harness.serving import server as servers
    from harness.serving.draft import ServedDraft
    from harness.serving.server import Completion, Session

    launches = []

    class Scripted:
        """A llama-server whose speed depends on which launch this is: alone, with the draft, alone again."""

        def __init__(self, engine, model, log, records, *drafter, **options):
            launches.append(log.name)
            self.speeds = {"server-alone-before.log": 100.0, "server-draft.log": 120.0}.get(log.name, 80.0)
            if options.get("spec_type", "").startswith("ngram"):
                self.speeds = 110.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def complete(self, prompt, tokens, *args, **kwargs):
            return Completion(list(prompt), accepted=[1, 2], drafted=[3, 3], tokens_per_s=self.speeds + len(prompt))

    sets = {"chat": [[1], [1, 2], [1, 2, 3]]}
    session = Session(None, tmp_path / "servers", tmp_path)
    draft = ServedDraft("run", "dflash", tmp_path / "d.gguf", 3, "dflash", 1)
    with mock.patch.object(servers, "LlamaServer", Scripted):
        config = SimpleNamespace(max_new_tokens=8, seed=0, ngram_peers=True)
        with_draft, peers, alone = served.serve_prompts(session, tmp_path / "t.gguf", draft, sets, [0.0], config)
    ngrams = [f"server-{kind}.log" for kind in served_names.NGRAM_TYPES]
    assert launches == ["server-alone-before.log", "server-draft.log", *ngrams, "server-alone-after.log"]
    assert [c.tokens_per_s for c in alone["chat", 0.0]] == [91.0, 92.0, 93.0]  # (100 + n + 80 + n) / 2
    # every n-gram type is paired with the same bracketed alone speeds: (110 * 3 + 6) / 276
    for kind, value in served.peer_metrics(peers, alone).items():
        assert value == pytest.approx(336 / 276 if not kind.endswith("_se") else 60 / 276 / 276 * 3**0.5), kind
    metrics = served.served_metrics(with_draft, alone, [])
    assert metrics["speedup"] == pytest.approx(366 / 276) and metrics["tokens_per_s_alone"] == pytest.approx(92.0)
    # Each request's influence (draft - R * alone) / sum(alone) = (1 - R) * (-1, 0, +1) / 276, R = 366 / 276; the
    # clustered se is sqrt(n / (n - 1) * sum of squares) = |1 - R| / 276 * sqrt(3)
    assert metrics["speedup_se"] == pytest.approx(abs(1 - 366 / 276) / 276 * 3**0.5, rel=1e-9)
    assert metrics["speedup_low"] < metrics["speedup"] < metrics["speedup_high"]


# ---- a reduced draft vocabulary (harness/serving/gguf.py, draft.py) -----------------------------------------


def tiny_gguf(path: Path, tensors: dict, fields: dict) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "dflash")
    writer.add_uint32("dflash.block_size", fields["block_size"])
    writer.add_array("tokenizer.ggml.tokens", fields["tokens"])
    writer.add_string("general.name", "tiny")
    for name, array in tensors.items():
        writer.add_tensor(name, np.asarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_reduced_vocabulary_draft_keeps_the_draft_and_adds_the_heads_rows_and_the_d2t_map(tmp_path):
    import numpy as np
    from gguf import GGUFReader

    from harness.serving.gguf import gguf_problem, with_reduced_vocabulary

    embeddings = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)  # 6 tokens, n_embd 4 (numpy order)
    layer = np.full((3, 4), 0.5, dtype=np.float32)
    fields = {"block_size": 4, "tokens": ["a", "b", "c", "d", "e", "f"]}
    draft = tiny_gguf(tmp_path / "draft.gguf", {"blk.0.attn_q.weight": layer}, fields)
    target = tiny_gguf(tmp_path / "target.gguf", {"token_embd.weight": embeddings}, fields)
    out = with_reduced_vocabulary(draft, target, [5, 0, 3], tmp_path / "draft-vocab3.gguf")
    assert gguf_problem(out) is None
    reduced = GGUFReader(out)
    tensors = {t.name: t for t in reduced.tensors}
    assert list(tensors["d2t"].data) == [5, 0, 3] and tensors["d2t"].tensor_type.name == "I64"
    assert np.array_equal(np.asarray(tensors["output.weight"].data), embeddings[[5, 0, 3]])
    assert [int(n) for n in tensors["output.weight"].shape] == [4, 3]  # ggml order: n_embd, draft vocabulary
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), layer)
    assert reduced.fields["dflash.block_size"].contents() == 4
    assert reduced.fields["tokenizer.ggml.tokens"].contents() == fields["tokens"]
    assert reduced.fields["general.architecture"].contents() == "dflash"


def test_the_reduced_vocabulary_is_the_replies_most_frequent_tokens_with_the_end_of_turn_kept():
    from types import SimpleNamespace

    from harness.serving.draft import frequent_tokens
    from harness.serving.engine import EngineError

    documents = [
        SimpleNamespace(input_ids=[1, 7, 7, 8, 9, 9, 9], loss_mask=[0, 1, 1, 1, 1, 1, 1]),
        SimpleNamespace(input_ids=[7, 4, 4, 4, 4], loss_mask=[1, 0, 0, 0, 1]),  # 4 counts once: where supervised
    ]
    # supervised counts: 9 x3, 7 x3, 8 x1, 4 x1; ties by id
    assert frequent_tokens(documents, 2) == [7, 9]
    assert frequent_tokens(documents, 3, always=(2,)) == [2, 7, 9]
    assert frequent_tokens(documents, 4) == [7, 9, 4, 8]
    with pytest.raises(EngineError, match=r"invalid vocabulary size=9: the run's replies hold 4 distinct tokens"):
        frequent_tokens(documents, 9)
