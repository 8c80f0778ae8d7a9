"""Setup's proof of an engine build: `llama-server` loads the shipped quantized target and decodes a few tokens.

A build for "this machine's" instruction sets can still die on it: a CPU may advertise AMX that the quantized
matmul kernels then cannot use (SIGILL at the first tile instruction), while the f32 path never reaches them. So
`scripts/llama_cpp.sh` runs this after every build, and on a cached one, and rebuilds without the instruction set
that failed. Exit status: 0 served; 3 the server was killed by a signal (the signal's name on stdout); 1 another
failure (its one line on stdout).

    python -m harness.serving.proof ENGINE_ROOT
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.serving.engine import Engine, EngineError
from harness.serving.server import ServerKilled, Session
from harness.targets import embedded_gguf_path

KILLED_BY_SIGNAL = 3
PROOF_MODEL = "smollm2-135m"  # its shipped GGUF is Q4_1: the quantized kernels are the ones that can fault
PROOF_TOKENS = 4


def prove(root: Path) -> int:
    engine = Engine(root)
    folder = root / "proof"
    try:
        with Session(engine, folder / "servers", folder).server(embedded_gguf_path(PROOF_MODEL), "server") as server:
            done = server.complete([1, 504, 3458, 314], PROOF_TOKENS, ignore_eos=True)
    except ServerKilled as killed:
        print(killed.signal_name)
        return KILLED_BY_SIGNAL
    except (EngineError, OSError) as error:
        print(str(error).splitlines()[0] if str(error) else type(error).__name__)
        return 1
    if len(done.tokens) != PROOF_TOKENS:
        print(f"llama-server decoded {len(done.tokens)} tokens where {PROOF_TOKENS} were asked for")
        return 1
    print(f"served {PROOF_TOKENS} tokens from {PROOF_MODEL}'s quantized GGUF")
    return 0


if __name__ == "__main__":
    sys.exit(prove(Path(sys.argv[1])))
