"""Many requests through one `llama-server` of the target (its f32 GGUF) with several slots decoding at once: the
server batches whatever slots are decoding (continuous batching), so a finished request's slot takes the next one
at once. Regeneration of replies and Magpie's instructions go through here."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.run import SERVED_DIR
from harness.serving.engine import find_engine
from harness.serving.gguf import target_gguf
from harness.serving.server import Completion, Session
from harness.targets import Target

# (key, prompt ids, new tokens, temperature, seed): one request
Job = tuple[Any, list[int], int, float, int]
Requests = Callable[[list[Job]], Iterator[tuple[Any, Completion]]]


@contextmanager
def parallel_requests(target: Target, workdir: Path, name: str, slots: int, tokens_per_slot: int) -> Iterator[Requests]:
    """`send(jobs)` yields `(key, completion)` as each lands, `slots` at a time; each slot holds `tokens_per_slot`
    (prompt and reply, rounded up to 256). The server logs to `<workdir>/served/<name>.log`."""
    engine = find_engine()
    model = target_gguf(engine, workdir, target)
    context = slots * 256 * math.ceil(tokens_per_slot / 256)
    session = Session.of(engine, workdir, workdir / SERVED_DIR)
    with session.server(model, name, slots=slots, context=context) as server, ThreadPoolExecutor(slots) as pool:

        def send(jobs: list[Job]) -> Iterator[tuple[Any, Completion]]:
            futures = {
                pool.submit(server.complete, ids, n, temperature, seed): key for key, ids, n, temperature, seed in jobs
            }
            try:
                for future in as_completed(futures):
                    yield futures[future], future.result()
            finally:  # stopped early (Ctrl-C, SIGTERM, a failed request): queued requests never start
                for future in futures:
                    future.cancel()

        yield send
