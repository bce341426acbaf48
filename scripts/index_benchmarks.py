"""Write docs/benchmarks/README.md: one table indexing the raw benchmark files (date, card, section, file).

    python scripts/index_benchmarks.py            (rewrite the index)
    python scripts/index_benchmarks.py --check    (exit 1 when the index is not what this would write)

A file is named `<card>-<date>[<session letter>]-[runN-][callN-]<what>.<ext>`, e.g.
`h200-2026-12-04c-call2-results.json`. The section comes from the contents where a JSON file says it (a
merged run's `benchmarks` keys, one benchmark's `benchmark`), else from <what> in the name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "benchmarks"
INDEX = "README.md"
HISTORY = "history.md"  # the diary of steps moved out of BENCHMARKS.md: prose, not a raw file
NOT_RAW = frozenset({INDEX, HISTORY})
_NAME = re.compile(r"^(?P<card>[a-z0-9]+)-(?P<date>\d{4}-\d{2}-\d{2})(?P<session>[a-z]?)(?:-(?P<what>.*))?$")
_RUN_CALL = re.compile(r"^(run|call)\d+$")  # a session's runs, not a section
_HEADER = """# Raw benchmark files

Every file here, indexed by `scripts/index_benchmarks.py` (do not edit the table by hand; run it after adding
files, and `tests/bench/test_benchmark_index.py` checks it). BENCHMARKS.md and the diary of steps,
[history.md](history.md), quote these files; the date's letter (`2026-12-02b`) tells apart sessions of one
day, `runN`/`callN` the runs of a session.

| date | card | section | file |
|---|---|---|---|
"""


@dataclass(frozen=True)
class Entry:
    """One raw file's row."""

    date: str
    card: str
    section: str
    file: str

    def row(self) -> str:
        return f"| {self.date} | {self.card} | {self.section} | [{self.file}]({self.file}) |"


def _stem(name: str) -> str:
    for ext in (".jsonl.gz", ".json", ".log", ".txt", ".png", ".gz", ".jsonl", ".csv"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name.rsplit(".", 1)[0]


def _section_from_contents(path: Path) -> str | None:
    """A JSON result's benchmarks: a merged run's `benchmarks` keys or one benchmark's `benchmark`."""
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("benchmarks"), dict) and data["benchmarks"]:
        return ", ".join(data["benchmarks"])
    if isinstance(data, dict) and isinstance(data.get("benchmark"), str):
        return data["benchmark"]
    return None


def entry(path: Path) -> Entry:
    """The index row of one raw file."""
    match = _NAME.match(_stem(path.name))
    if match is None:
        return Entry("?", "?", _stem(path.name), path.name)
    what = "-".join(t for t in (match["what"] or "").split("-") if not _RUN_CALL.match(t)) or "run"
    kind = {".log": " (log)", ".txt": " (text)", ".png": " (plot)"}.get(path.suffix, "")
    section = _section_from_contents(path) or f"{what}{kind}"
    return Entry(match["date"] + match["session"], match["card"], section, path.name)


def raw_files(directory: Path = BENCH_DIR) -> list[Path]:
    """Every file the index covers: all but the index itself and the history."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name not in NOT_RAW)


def render(directory: Path = BENCH_DIR) -> str:
    """The index's text."""
    rows = sorted((entry(p) for p in raw_files(directory)), key=lambda e: (e.date, e.file))
    return _HEADER + "".join(e.row() + "\n" for e in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/index_benchmarks.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the index is out of date")
    args = parser.parse_args(argv)
    text, index = render(), BENCH_DIR / INDEX
    if args.check:
        current = index.read_text() if index.exists() else ""
        if current != text:
            print(f"{index} is out of date: run python scripts/index_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {index} ({len(raw_files())} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
