"""Packaging: what the packages import is declared in pyproject.toml, and what is declared is used."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ("algorithms", "harness", "studies", "reports")
# Declared but never imported by name: each is reached through another library.
USED_INDIRECTLY = {
    "accelerate": "transformers refuses to load a GGUF (the embedded target) without it",
    "gguf": "transformers reads the embedded target's GGUF with it",
    "psutil": "MLflow's system metrics (--system-metrics)",
    "psycopg": "Optuna's PostgreSQL storage, a postgresql:// URL",
}


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonical(re.match(r"[A-Za-z0-9_.-]+", spec).group()) for spec in project["dependencies"]}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> set[str]:
    """Top-level modules every file of the packages imports (at any depth: lazy imports count)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


def test_every_imported_distribution_is_declared_and_every_declared_one_is_used():
    """A module is covered when one of the distributions that provide it is declared (`mlflow` comes in three)."""
    distributions = importlib.metadata.packages_distributions()
    providers = {module: {canonical(d) for d in distributions.get(module, [module])} for module in imported_modules()}
    undeclared = sorted(module for module, names in providers.items() if not names & declared())
    assert undeclared == [], "imported but not declared in pyproject.toml"
    used = set().union(*providers.values())
    unused = declared() - used - set(USED_INDIRECTLY)
    assert unused == set(), "declared but neither imported nor used through another library"
    assert set(USED_INDIRECTLY) <= declared()
