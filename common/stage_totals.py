"""Seconds per stage summed over many calls, read together with their count (thread-safe).

Both services split a call's latency into stages that add up to it (the encoder an Encode's,
encoder_svc/stages.py; the decoder a request's time to first token, decoder_svc/engine/ttft_stages.py)
and export the sums in GetStats beside the number of calls, so a client takes the mean per stage from two
snapshots.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class StageTotals:
    """Seconds per stage summed over every call, and the number of calls."""

    def __init__(self, stages: Iterable[str]) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)
        self.calls = 0
        self._lock = threading.Lock()

    def add(self, split: dict[str, float]) -> None:
        """Count one call's split."""
        with self._lock:
            self.calls += 1
            for stage, secs in split.items():
                self.seconds[stage] = self.seconds.get(stage, 0.0) + secs

    def snapshot(self) -> tuple[dict[str, float], int]:
        """(seconds per stage, calls) read together."""
        with self._lock:
            return dict(self.seconds), self.calls
