"""Latency summaries: mean, p50 and p99 in milliseconds, the way `vllm bench serve` reports them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values_s: Sequence[float]) -> dict[str, float | int]:
    """{"n", "mean_ms", "p50_ms", "p99_ms"} of durations given in seconds (NaN when empty)."""
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"n": len(ms), "mean_ms": mean, "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def ratio(num: float, den: float) -> float | None:
    """num / den, or None when den is zero (JSON null, not a division error)."""
    return num / den if den else None


def clean(obj):
    """obj with NaN/inf floats turned into None, so json.dump writes valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj
