"""The serving engine's refusals, each in one line with nothing left running, on a stand-in engine (scripts that
behave like llama.cpp's converter and server where it matters); the real engine's end-to-end test is in
tests/test_decode_e2e.py."""

import sys

import pytest

from harness.serving import Engine, EngineError, LlamaServer, find_engine, free_port, to_gguf

from conftest import tiny_draft

# A stand-in llama-server: answers /health on its port, or fails the way the real one does.
FAKE_SERVER = """\
#!{python}
import http.server, os, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
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
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

FAKE_CONVERTER = """\
import sys
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
        "converting run my-run to GGUF failed: "
        "ValueError: DFlash draft model requires --target-model-dir to be specified."
    )
    assert not list(tmp_path.glob("draft.gguf*")), "no half-written GGUF is left"


def test_a_server_that_does_not_start_gives_its_last_log_lines_and_leaves_nothing_running(
    engine, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_MODE", "broken")
    server = LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log")
    with pytest.raises(EngineError, match=r"exited with status 1: .*error loading model.*exiting due to model"), server:
        pass
    assert server.process is None


def test_a_taken_port_moves_to_another(engine, tmp_path, monkeypatch):
    busy = free_port()
    monkeypatch.setenv("FAKE_BUSY_PORT", str(busy))
    with LlamaServer(engine, tmp_path / "model.gguf", tmp_path / "server.log", port=busy) as server:
        assert server.port != busy and server.process.poll() is None
        process = server.process
    assert process.poll() is not None, "the server is stopped on leaving the block"


def test_a_member_without_an_export_format_is_refused_in_one_line():
    from harness.served import check_servable

    with pytest.raises(EngineError, match=r"invalid --engine=llama.cpp for run of domino: cannot export a domino"):
        check_servable(tiny_draft("domino"))


def test_a_selector_lattice_wider_than_the_hidden_size_is_refused():
    """llama.cpp's DFlash2 lattice holds K + K*K scores per row in the hidden width: K(K + 1) <= hidden."""
    from harness.served import check_servable

    check_servable(tiny_draft("dflash2", candidate_top_k=7))  # 56 <= 64
    with pytest.raises(EngineError, match=r"top_k \* \(top_k \+ 1\) = 72 in llama.cpp, the target has 64; allowed "):
        check_servable(tiny_draft("dflash2", candidate_top_k=8))


def test_served_cycles_are_compared_only_where_both_drafted_the_whole_block():
    from harness.served import compare_cycles
    from harness.serving import Completion

    served = Completion(tokens=[], accepted=[0, 2, 1, 0], drafted=[7, 7, 7, 3])
    assert compare_cycles([0, 2, 1, 1], [7, 7, 7, 2], served, 7)[:2] == (3, 3)  # the budget-cut last is left out
    compared, identical, divergence = compare_cycles([0, 3, 1], [7, 7, 7], served, 7)
    assert (compared, identical) == (2, 1) and (divergence.cycle, divergence.harness_accepted) == (1, 3)


def test_the_served_log_line_pattern_reads_the_real_servers_lines():
    from harness.serving import CYCLE_LINE

    line = "0.24.561.702 I slot   operator(): id  0 | task 12 | accepted  3/ 7 draft tokens"
    found = CYCLE_LINE.search(line)
    assert (found["task"], found["accepted"], found["drafted"]) == ("12", "3", "7")
