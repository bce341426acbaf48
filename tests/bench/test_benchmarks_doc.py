"""BENCHMARKS.md and its history (docs/benchmarks/history.md): links resolve, cited sections exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks" / "history.md"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _broken_links(path: Path) -> list[str]:
    targets = [t for t in _LINK.findall(path.read_text()) if "://" not in t]
    return [t for t in targets if not (path.parent / t).exists()]


def test_every_relative_link_points_to_a_file_that_exists():
    for path in (BENCHMARKS, HISTORY):
        assert not _broken_links(path), f"{path.name}: broken links {_broken_links(path)}"


def test_a_link_to_a_missing_file_is_reported(tmp_path):
    (tmp_path / "there.json").write_text("{}")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](there.json) [b](gone.json#x) [c](https://example.invalid/x)")
    assert _broken_links(doc) == ["gone.json"]


def test_benchmarks_links_its_history_and_keeps_the_sections_the_code_cites():
    text = BENCHMARKS.read_text()
    assert "](docs/benchmarks/history.md)" in text
    # common/vision/tower_graphs.py cites this section of BENCHMARKS.md by name
    assert "## Figures from the code's docstrings" in text
    # README.md, docs/ and common/freed_memory.py cite these by name; they live in the history now
    history = HISTORY.read_text()
    cited_names = ("Gemma 3", "Phi-4-multimodal", "Embeddings over NIXL",
                   "Page faults on every request's bytes")
    for cited in cited_names:
        assert f"### {cited}" in history or f"**{cited}" in history, cited
