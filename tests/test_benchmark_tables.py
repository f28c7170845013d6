"""The benchmark tables of the docs are rendered from the recorded JSON results."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _render_tables():
    spec = importlib.util.spec_from_file_location("render_tables",
                                                  ROOT / "benchmarks" / "render_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_tables = _render_tables()


def test_docs_tables_are_up_to_date_with_the_json():
    page = render_tables.PAGE.read_text()
    tables = render_tables.load_tables()
    assert render_tables.render(page, tables) == page, \
        "docs/benchmarks/measurements.md is stale: run python benchmarks/render_tables.py"
    assert render_tables.main(["--check"]) == 0


def test_every_record_is_shown_once_and_names_its_origin():
    page = render_tables.PAGE.read_text()
    ids = render_tables.marked_ids(page)
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(render_tables.load_tables())
    for table_id, record in render_tables.load_tables().items():
        assert record["date"].startswith("20"), table_id
        assert record["machine"] and record["versions"], table_id
        for source in record["sources"]:
            assert (ROOT / source).is_file(), (table_id, source)
            raw = json.loads((ROOT / source).read_text())
            # raw runs carry their date (newer runs inside the machine record)
            assert raw.get("date") or raw["machine"].get("date"), source
            if isinstance(record["machine"], dict):  # copied from the raw run's record
                assert record["machine"]["cpu_name"] == raw["machine"]["cpu_name"]
                assert record["versions"]["torch"] == raw["machine"]["torch"]


def test_unmarked_tables_are_not_left_in_the_page():
    # every table row of the page lies inside a marked block
    page = render_tables.PAGE.read_text()
    outside = render_tables._BLOCK.sub("", page)
    assert not [line for line in outside.splitlines() if line.startswith("|")]


def test_render_replaces_only_the_marked_block(tmp_path):
    record = {"date": "2026-01-01", "machine": "a test machine", "versions": "torch 2",
              "sources": [], "columns": ["a", "b"], "rows": [["x", 1.5]]}
    page = "intro\n\n<!-- table: t -->\nold\n<!-- /table -->\n\nmore\n"
    new = render_tables.render(page, {"t": record})
    assert new.startswith("intro\n\n<!-- table: t -->\n| a | b |\n|---|---|\n| x | 1.5 |\n")
    assert "recorded 2026-01-01; a test machine; torch 2." in new and new.endswith("more\n")
    assert render_tables.render(new, {"t": record}) == new
    with pytest.raises(KeyError, match="no u.json"):
        render_tables.render(page.replace("table: t", "table: u"), {"t": record})
    (tmp_path / "bad.json").write_text(json.dumps({**record, "rows": [["only one"]]}))
    with pytest.raises(ValueError, match="1 cells, not 2"):
        render_tables.load_tables(tmp_path)
    del record["date"]
    (tmp_path / "bad.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="lacks date"):
        render_tables.load_tables(tmp_path)
