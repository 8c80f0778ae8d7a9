"""The docs stay true: every fenced shell command of the README and docs/ still parses, and every relative link
and every repository path they name exists.

A command is checked in a cheap form: `dflash-lab ...` (and `python -m harness.cli ...` under torchrun) by the
command line's own parser, `python -m benchmarks.X ...` by that benchmark's parser, a script by its existence. A
line that none of these covers must say why it is not run: `# docs-test: skip (reason)`.
"""

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"docs-test:\s*skip\s*\((?P<reason>[^)]+)\)")
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
# Outputs the docs name that a run creates; they need not exist in a checkout.
GENERATED = {"benchmarks/training/GPU_CHECK.json"}
TOP_LEVEL = ("algorithms", "harness", "studies", "reports", "tests", "benchmarks", "docs", "scripts", "examples")


def shell_lines(page: Path) -> list[tuple[str, str]]:
    """(command line without its comment, the comment) of every fenced shell line, continuations joined."""
    found = []
    for block in SHELL_BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition(" #")
            if command.lstrip().startswith("#"):
                command, comment = "", command
            if command.strip():
                found.append((command.strip(), comment))
    return found


COMMANDS = [
    pytest.param(command, comment, id=f"{page.name}: {command[:60]}")
    for page in PAGES
    for command, comment in shell_lines(page)
]


class Parsed(Exception):
    """Raised by the patched parse_args: the arguments parsed, nothing ran."""


def parses(parser_owner, argv: list[str]) -> None:
    """Run `parser_owner(argv)` only as far as its argparse parser; a bad flag or value fails the test."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), pytest.raises(Parsed):
        parser_owner(argv)


def check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment prefix
        words = words[1:]
    program, args = Path(words[0]).name, words[1:]
    if program == "dflash-lab":
        from harness.cli import build_parser

        build_parser().parse_args(args)
    elif program == "torchrun":
        assert "-m" in args and args[args.index("-m") + 1] == "harness.cli", words
        from harness.cli import build_parser

        build_parser().parse_args(args[args.index("-m") + 2 :])
    elif program.startswith("python") and args[:1] == ["-m"] and args[1].startswith("benchmarks."):
        module = importlib.import_module(args[1])
        with mock.patch.object(sys, "argv", [args[1], *args[2:]]):
            parses(lambda argv: module.main(argv) if module.main.__code__.co_argcount else module.main(), args[2:])
    elif program.startswith("python") and args[:2] == ["-m", "pytest"]:
        assert importlib.util.find_spec("pytest")
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), f"no script {args[0]}"
    elif program == "ruff":
        assert (Path(sys.executable).parent / "ruff").exists()
    else:
        raise AssertionError(f"no cheap form for {program!r}: mark the line `# docs-test: skip (reason)`")


@pytest.mark.parametrize(("command", "comment"), COMMANDS)
def test_every_documented_command_still_parses(command, comment):
    if skip := SKIP.search(comment):
        pytest.skip(skip.group("reason"))
    for part in re.split(r"\s*(?:&&|;|\|)\s*", command):
        check_command(shlex.split(part))


def named_paths(page: Path) -> list[str]:
    """Relative link targets (resolved against the page) and repository paths in backticks (against the root)."""
    text = page.read_text()
    paths = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            paths.append(str((page.parent / target.split("#")[0]).resolve().relative_to(ROOT)))
    for quoted in re.findall(r"`([^`\s]+)`", text):
        path = quoted.split("::")[0].rstrip(".,;:")
        if path.split("/")[0] in TOP_LEVEL and "/" in path and not re.search(r"[<>*{}$|]", path):
            paths.append(path)
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_named_path_exists(page):
    missing = [path for path in named_paths(page) if path not in GENERATED and not (ROOT / path).exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_the_docs_name_pages_that_exist_and_the_readme_links_every_one():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# ---- the README is not a changelog -------------------------------------------------------------------------

README_MAX_LINES = 110
# A measured figure: a decimal (0.712, +0.234) or a clock time (16:11); integers are counts and settings.
FIGURE = re.compile(r"(?<![\w./:-])[+\-−]?\d+(?:[.:]\d+)+(?![\w./:])")
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def quoted_figures(text: str) -> list[str]:
    """The figures a page quotes: in its prose and text blocks, not in its commands, links or URLs."""
    text = re.sub(r"```(?:bash|sh|shell)\n.*?```", "", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)|https?://\S+|\S+://\S*", "", text)
    return [figure.replace("−", "-") for figure in FIGURE.findall(text)]


def recorded_text() -> str:
    """Everything the benchmark records hold, minus signs written one way."""
    from benchmarks.common import records

    folders = records.BENCHMARKS.glob("*/records/*/*.json")
    return "\n".join(path.read_text() for path in sorted(folders)).replace("−", "-").replace("\\u2212", "-")


def test_the_readme_is_one_screen_or_two_with_no_commit_and_at_most_one_date():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "dated measurements belong in benchmark records and docs"
    assert not COMMIT_HASH.findall(text), f"commit hashes in the README: {COMMIT_HASH.findall(text)}"
    assert len(DATE.findall(text)) <= 1, f"dates in the README: {DATE.findall(text)}"


def test_every_figure_the_readme_quotes_is_held_by_a_benchmark_record():
    held = recorded_text()
    figures = quoted_figures((ROOT / "README.md").read_text())
    assert figures, "the README quotes its timings and verdicts"
    missing = [figure for figure in figures if not re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", held)]
    assert not missing, f"figures the README quotes that no benchmark record holds: {missing}"


def test_the_figure_check_can_fail():
    assert quoted_figures("took 16:11, gained +0.234 [−0.040, 2.5] with `--steps 60` and 3 seeds") == [
        "16:11",
        "+0.234",
        "-0.040",
        "2.5",
    ]
    assert quoted_figures("```bash\ntrain --lr 0.001\n```\nsee [x](docs/v1.2.md), http://127.0.0.1:5000") == []
    held = recorded_text()
    assert "16:11" in held and "99:98:97" not in held
