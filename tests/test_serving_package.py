"""The serving code has one owner, `harness/serving/`: no file of the project outside it starts `llama-server` or
spells a served metric's name (tests may: they check the package from outside)."""

import ast
from pathlib import Path

from harness.serving import metrics as served_names

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "harness" / "serving"
OUTSIDE = [
    path
    for folder in ("algorithms", "harness", "studies", "reports", "benchmarks", "scripts", "examples")
    for path in sorted((ROOT / folder).rglob("*.py"))
    if PACKAGE not in path.parents
]


def string_literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant of the file, f-strings' literal parts included, with its line."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_the_checked_files_are_the_projects():
    names = {path.relative_to(ROOT).as_posix() for path in OUTSIDE}
    assert {"harness/cli.py", "studies/runner.py", "reports/render.py", "benchmarks/serving/speedup.py"} <= names
    assert not any(name.startswith("harness/serving/") for name in names)


def test_no_file_outside_the_serving_package_starts_a_server():
    starting = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in OUTSIDE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "LlamaServer(" in line or 'llama-server",' in line
    ]
    assert not starting, f"llama-server started outside harness/serving/: {starting}"


def test_no_file_outside_the_serving_package_spells_a_served_metric_name():
    spelled = [
        f"{path.relative_to(ROOT)}:{number}: {value!r}"
        for path in OUTSIDE
        for number, value in string_literals(path)
        if value in served_names.NAMES or value.startswith(served_names.PREFIX)
    ]
    assert not spelled, f"served metric names spelled outside harness/serving/metrics.py: {spelled}"


def test_the_names_are_distinct_and_the_objectives_read_summary_metrics():
    assert len(set(served_names.NAMES)) == len(served_names.NAMES)
    assert set(served_names.OBJECTIVES.values()) <= set(served_names.SUMMARY)
    assert set(served_names.COLUMNS.values()) <= {
        *served_names.SUMMARY,
        served_names.CYCLES_COMPARED,
        served_names.se(served_names.SPEEDUP),
        served_names.ROUNDS,
        served_names.LAUNCH_VARIANCE,
    }


def test_the_grep_would_catch_a_planted_spelling(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(f'value = metrics["{served_names.BREAK_EVEN}"]\nkey = f"{served_names.PREFIX}{{name}}"\n')
    found = [value for _, value in string_literals(planted)]
    assert served_names.BREAK_EVEN in found and any(v.startswith(served_names.PREFIX) for v in found)
