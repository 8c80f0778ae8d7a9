"""Benchmark results are data: every page under benchmarks/ is what its records render, and a record carries its
provenance (machine, date, commit, command)."""

import json

import pytest

from benchmarks.common import records
from benchmarks.common.records import Page, Provenance, Record, Table

PAGES = [pytest.param(page, id=str(page.path.relative_to(records.BENCHMARKS))) for page in records.pages()]


def test_every_markdown_page_of_the_benchmarks_has_records():
    pages = {page.path for page in records.pages()}
    markdown = set(records.BENCHMARKS.glob("*/*.md"))
    assert markdown and markdown == pages, f"pages without records: {sorted(markdown - pages)}"


@pytest.mark.parametrize("page", PAGES)
def test_a_page_is_what_its_records_render(page: Page):
    assert page.path.read_text() == page.render(), (
        f"{page.path} differs from its records: never edit it by hand; `python -m benchmarks.common.records` "
        "renders every page again"
    )


@pytest.mark.parametrize("page", PAGES)
def test_every_record_reads_back_as_written(page: Page):
    for path in sorted(page.folder.glob("*.json")):
        if path.name == records.PAGE_FILE:
            assert json.loads(path.read_text())["title"]
            continue
        data = json.loads(path.read_text())
        assert Record.from_json(data).to_json() == data, path


def test_a_new_record_holds_its_provenance_and_renders_into_its_page(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "BENCHMARKS", tmp_path)
    page = Page.named("serving", "DEMO")
    page.folder.mkdir(parents=True)
    (page.folder / records.PAGE_FILE).write_text(json.dumps({"title": "A demo"}))
    found = Record(
        "first",
        ["what was measured", Table(["a", "b"], [["1", "2.50"]])],
        {"b": 2.5},
        Provenance.now(command="python -m benchmarks.serving.demo --x 1"),
    )
    written = page.add(found)
    data = json.loads(written.read_text())
    provenance = data["provenance"]
    assert provenance["command"] == "python -m benchmarks.serving.demo --x 1" and provenance["cores"] >= 1
    assert provenance["cpu"] and provenance["date"].endswith("UTC") and "torch" in provenance
    assert provenance["commit"] is None or len(provenance["commit"].removesuffix("-dirty")) == 9
    assert data["values"] == {"b": 2.5}
    text = page.path.read_text()
    assert text.startswith("# A demo\n") and "## first" in text and "| 1 | 2.50 |" in text
    assert provenance["date"] in text and text == page.render()
    page.path.write_text(text.replace("2.50", "2.60"))  # a hand edit
    assert page.path.read_text() != page.render()
