"""Benchmark output: the environment block, JSON files and printed tables (rich when installed)."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.stats import clean


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str = "cpu") -> dict[str, Any]:
    """Where and when the numbers were taken: device name, versions, UTC time."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"CPU {_cpu_model()} ({torch.get_num_threads()} threads)"
    return {"device": str(dev), "device_name": name, "torch": torch.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
            "argv": sys.argv}


def write_json(path: str | Path | None, payload: dict) -> None:
    """Write payload as indented JSON (NaN becomes null); no-op when path is None."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(clean(payload), indent=2, default=str) + "\n")


def save_result(name: str, args: Any, results: Any, **extra: Any) -> dict:
    """The standard payload of a benchmark (name, environment, config, results, extras), written to
    args.out when set; returns it."""
    env = environment(getattr(args, "device", "cuda"))  # a CUDA-only benchmark has no --device
    payload = {"benchmark": name, "env": env, "config": vars(args), **extra, "results": results}
    write_json(args.out, payload)
    return payload


def fmt(value: Any) -> str:
    """A compact cell: floats with 4 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table on stdout: rich's when it is installed, aligned plain text otherwise."""
    cells = [[fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(str(h).ljust(w) for h, w in zip(columns, widths, strict=True)))
        for row in cells:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(str(col), justify="left" if i == 0 else "right")
    for row in cells:
        table.add_row(*row)
    Console(width=max(100, sum(len(str(c)) for c in columns) + 20)).print(table)


def latency_rows(summary: dict, metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2e")) -> list[list]:
    """Rows [metric, mean, p50, p99] from a summary holding {metric: {"mean_ms", ...}}."""
    return [[m.upper(), summary[m]["mean_ms"], summary[m]["p50_ms"], summary[m]["p99_ms"]]
            for m in metrics if m in summary]
