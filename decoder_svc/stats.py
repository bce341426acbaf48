"""The decoder service's one stats record (see common/stats.py): GetStats, /metrics and the log line
all read it. The engine core builds it, so the engine's and the embedding source's counters are read
together, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from common.stats import summary
from decoder_svc.encoders.source_stats import RemoteSourceStats
from decoder_svc.engine.engine import EngineStats
from decoder_svc.engine.ttft_stages import FirstTokenStats

# What the periodic log line shows.
_LOGGED = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_hit_tokens",
           "requests_finished", "requests_aborted", "requests_failed", "encoders")


@dataclass
class DecoderStats:
    """The engine's state and counters, and its encoders' side (with the routing ring's size)."""

    engine: EngineStats
    source: RemoteSourceStats | None = None  # None: an in-process source (tests)
    first_token: FirstTokenStats | None = None  # the front end's TTFT split (None: read in the core)

    def log_line(self) -> str:
        """The compact form for the service's log."""
        return summary(self, _LOGGED)
