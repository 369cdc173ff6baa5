"""The rollout API's benchmark table is one table: docs/performance.md shows the API README's rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("api_bench", ROOT / "benchmarks" / "api_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_bench", module)
    spec.loader.exec_module(sys.modules["api_bench"])
    return sys.modules["api_bench"]


def test_the_api_readme_and_the_performance_page_show_the_same_api_rows():
    bench = _bench()
    api = (ROOT / "atroposlib" / "api" / "README.md").read_text()
    block = api[api.index(bench.TABLE_START) : api.index(bench.TABLE_END)]
    rows = bench.table_rows(block)
    assert len(rows) >= 8
    assert bench.MAIN_README == ROOT / "docs" / "performance.md"
    assert bench.table_rows(bench.MAIN_README.read_text()) == rows


def test_write_readmes_replaces_both_tables(tmp_path, monkeypatch):
    bench = _bench()
    api = tmp_path / "api.md"
    main = tmp_path / "main.md"
    api.write_text(f"intro\n{bench.TABLE_START}\nold\n| API a | 1 |\n{bench.TABLE_END}\nafter\n")
    main.write_text("| what |\n|---|\n| API a | 1 |\n| API b | 1 |\n| other | 2 |\n")
    monkeypatch.setattr(bench, "API_README", api)
    monkeypatch.setattr(bench, "MAIN_README", main)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    bench.write_readmes("Measured now.\n\n| what |\n|---|\n| API a | 9 |\n| API b | 8 |")
    assert api.read_text() == (
        f"intro\n{bench.TABLE_START}\nMeasured now.\n\n| what |\n|---|\n| API a | 9 |\n"
        f"| API b | 8 |\n{bench.TABLE_END}\nafter\n"
    )
    # the performance page keeps its own header and other rows; its API block becomes the new rows
    assert main.read_text() == "| what |\n|---|\n| API a | 9 |\n| API b | 8 |\n| other | 2 |\n"
    # a different count of rows is refused rather than guessed at
    with pytest.raises(SystemExit):
        bench.write_readmes("| API a | 9 |")
