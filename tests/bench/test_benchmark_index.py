"""docs/benchmarks/README.md (scripts/index_benchmarks.py): every raw benchmark file has its row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _indexer():
    path = ROOT / "scripts" / "index_benchmarks.py"
    spec = importlib.util.spec_from_file_location("index_benchmarks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_every_raw_benchmark_file_is_indexed():
    indexer = _indexer()
    index = (indexer.BENCH_DIR / indexer.INDEX).read_text()
    files = indexer.raw_files()
    assert len(files) >= 222
    rows = [line for line in index.splitlines() if line.startswith("| 20")]
    linked = {line.rsplit("](", 1)[1].rstrip(" |)") for line in rows}
    missing = [p.name for p in files if p.name not in linked]
    assert not missing, f"not in docs/benchmarks/README.md (run scripts/index_benchmarks.py): {missing}"
    assert index == indexer.render(), "docs/benchmarks/README.md is stale: run scripts/index_benchmarks.py"


def test_a_row_takes_date_card_and_section_from_the_name_and_contents(tmp_path):
    indexer = _indexer()
    (tmp_path / "h100-2026-12-07b-call2-results.json").write_text('{"benchmarks": {"ttft": {}, "soak": {}}}')
    (tmp_path / "h200-2026-12-08-run3-soak-encoder.log").write_text("")
    rows = {e.file: e for e in map(indexer.entry, indexer.raw_files(tmp_path))}
    merged = rows["h100-2026-12-07b-call2-results.json"]
    assert (merged.date, merged.card, merged.section) == ("2026-12-07b", "h100", "ttft, soak")
    log = rows["h200-2026-12-08-run3-soak-encoder.log"]
    assert (log.date, log.card, log.section) == ("2026-12-08", "h200", "soak-encoder (log)")


def test_the_index_and_the_history_are_not_raw_files(tmp_path):
    indexer = _indexer()
    for name in ("README.md", "history.md", "h200-2026-12-05-call2-results.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in indexer.raw_files(tmp_path)] == ["h200-2026-12-05-call2-results.json"]
    assert (indexer.BENCH_DIR / indexer.HISTORY).is_file()
