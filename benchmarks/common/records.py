"""Benchmark results as data, with one owner for their provenance.

Each measurement is one JSON record under `<group>/records/<PAGE>/`: the machine, the date, the project's and the
engine's commits, the command that measured it, and what it found (paragraphs and tables, plus raw `values` a
script can compare across commits). A page `<group>/<PAGE>.md` is rendered from its records alone, oldest first,
and never edited by hand: `python -m benchmarks.common.records` renders every page again, and a test checks that
each page is what its records render. Interpretation lives in docs/results.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent
ROOT = BENCHMARKS.parent
PAGE_FILE = "page.json"  # beside a page's records: its title and what it measures
# The CPU features a reader needs to compare timings across machines.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Provenance:
    """Where and how a record was measured."""

    date: str  # "2026-12-06 10:40 UTC"
    cpu: str
    cores: int
    cpu_flags: list[str]
    commit: str | None  # the project's HEAD, "-dirty" when the tree had changes; None when not a checkout
    command: str
    torch: str
    engine: str | None = None  # llama.cpp's commit, for a served measurement
    derived: bool = False  # read from other records, measuring nothing (the machine is where it was read)

    @classmethod
    def now(cls, command: str | None = None, engine: str | None = None, derived: bool = False) -> Provenance:
        import torch

        return cls(
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            cpu=cpu_model(),
            cores=os.cpu_count() or 1,
            cpu_flags=cpu_flags(),
            commit=project_commit(),
            command=command or "python -m " + " ".join([module_of(sys.argv[0]), *sys.argv[1:]]),
            torch=torch.__version__,
            engine=engine,
            derived=derived,
        )

    def to_json(self) -> dict:
        """Its fields, `derived` only where set: a measured record reads back as it was written before it existed."""
        fields = asdict(self)
        if not self.derived:
            del fields["derived"]
        return fields

    @property
    def machine(self) -> str:
        """`AMD EPYC (2 cores; avx2)`: the CPU a record was measured on, as its line names it."""
        return f"{self.cpu} ({self.cores} cores; {', '.join(self.cpu_flags) or 'no AVX2'})"

    def line(self) -> str:
        engine = f", llama.cpp {self.engine[:9]}" if self.engine else ""
        commit = f"commit {self.commit}" if self.commit else "no commit recorded"
        if self.derived:
            return f"*Read {self.date} from recorded results, nothing measured, {commit}: `{self.command}`.*"
        return f"*Measured {self.date} on {self.machine}, torch {self.torch}{engine}, {commit}: `{self.command}`.*"


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [self.columns, ["---"] * len(self.columns), *self.rows]
        return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


@dataclass
class Record:
    """One measurement: a heading, its paragraphs and tables in order, and the raw numbers behind them."""

    title: str
    blocks: list[str | Table]
    values: dict = field(default_factory=dict)
    provenance: Provenance | None = None  # None only for results measured before records existed (their text says)

    @property
    def machine(self) -> str | None:
        """The CPU it was measured on (Provenance.machine); None for a record from before provenance."""
        return self.provenance.machine if self.provenance else None

    def markdown(self) -> str:
        parts = [f"## {self.title}"]
        if self.provenance is not None:
            parts.append(self.provenance.line())
        parts += [block.markdown() if isinstance(block, Table) else block for block in self.blocks]
        return "\n\n".join(parts)

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "provenance": self.provenance.to_json() if self.provenance else None,
            "blocks": [{"table": asdict(b)} if isinstance(b, Table) else {"text": b} for b in self.blocks],
            "values": self.values,
        }

    @classmethod
    def from_json(cls, data: dict) -> Record:
        blocks = [Table(**b["table"]) if "table" in b else b["text"] for b in data["blocks"]]
        provenance = Provenance(**data["provenance"]) if data["provenance"] else None
        return cls(data["title"], blocks, data.get("values", {}), provenance)


@dataclass(frozen=True)
class Page:
    """A benchmark's markdown page, `<group>/<NAME>.md`, and its records folder."""

    path: Path

    @classmethod
    def named(cls, group: str, name: str) -> Page:
        return cls(BENCHMARKS / group / f"{name}.md")

    @property
    def folder(self) -> Path:
        return self.path.parent / "records" / self.path.stem

    def titled(self, title: str) -> Page:
        """The page, created with this title if it has no records yet."""
        if not (self.folder / PAGE_FILE).is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / PAGE_FILE).write_text(json.dumps({"title": title}, indent=1, ensure_ascii=False) + "\n")
        return self

    def meta(self) -> dict:
        return json.loads((self.folder / PAGE_FILE).read_text())

    def records(self) -> list[Record]:
        files = sorted(p for p in self.folder.glob("*.json") if p.name != PAGE_FILE)
        return [Record.from_json(json.loads(p.read_text())) for p in files]

    def render(self) -> str:
        meta = self.meta()
        parts = [f"# {meta['title']}", *([meta["about"]] if meta.get("about") else [])]
        folder = self.folder.resolve().relative_to(BENCHMARKS.resolve())
        parts.append(f"*Generated from the records in `{folder}/`; do not edit.*")
        parts += [record.markdown() for record in self.records()]
        return "\n\n".join(parts) + "\n"

    def add(self, record: Record) -> Path:
        """Write the record (named by its date and title) and render the page again."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        path = self.folder / f"{stamp}-{slug(record.title)}.json"
        path.write_text(json.dumps(record.to_json(), indent=1, ensure_ascii=False) + "\n")
        self.path.write_text(self.render())
        return path

    def publish(self, record: Record) -> Path:
        """`add`, and say on the terminal what was recorded and where the page is."""
        written = self.add(record)
        print(record.markdown())
        print(f"recorded {written}; rendered {self.path}")
        return written


def pages() -> list[Page]:
    """Every page that has records."""
    return [Page(folder.parent.parent / f"{folder.name}.md") for folder in sorted(BENCHMARKS.glob("*/records/*"))]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "record"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in CPU_FLAGS if flag in present]
    return []


def machine_kind() -> str:
    """`AMD EPYC, native bf16`: the CPU and whether `auto` computes in bf16 on it (harness.devices decides)."""
    from harness.devices import cpu_has_native_bf16

    return f"{cpu_model()}, {'native bf16' if cpu_has_native_bf16() else 'no native bf16'}"


def project_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=9", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def module_of(script: str) -> str:
    """`benchmarks/serving/speedup.py` -> `benchmarks.serving.speedup` (as `python -m` names it)."""
    path = Path(script).resolve()
    try:
        return ".".join(path.relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return script


def page_argument(parser, group: str, default: str | None) -> None:
    """`--page NAME`: the page of `<group>/` a run's record is added to."""
    shown = f"benchmarks/{group}/{default}.md" if default else "chosen by the options"
    parser.add_argument("--page", help=f"the page the record is added to, by name (default: {shown})")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Render every benchmark page again from its records.")
    parser.parse_args(argv)
    for page in pages():
        page.path.write_text(page.render())
        print(f"rendered {page.path.relative_to(ROOT)} from {len(page.records())} records")


if __name__ == "__main__":
    main()
