"""Prometheus metrics of the decoder service."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from common.stats_metrics import StatsCollector
from decoder_svc.engine.ttft_stages import STAGES
from decoder_svc.stats import DecoderStats

_STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DecoderMetrics:
    """Latency histograms, requests by outcome, and the stats record's fields."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        kw = {"registry": registry}
        self.ttft = Histogram("mmserve_decoder_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, **kw)
        self.itl = Histogram("mmserve_decoder_inter_token_latency_seconds", "Time between output chunks",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.e2e = Histogram("mmserve_decoder_request_latency_seconds", "Whole request latency",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.requests = Counter("mmserve_decoder_requests", "Requests by how they ended", ["outcome"], **kw)
        self.ttft_stages = Histogram(
            "mmserve_decoder_ttft_stage_seconds", "Time to first token per stage (input, submit, inbox, "
            "encode, queue, prefill, output: they add up to the TTFT)", ["stage"], buckets=_STAGE_BUCKETS,
            **kw)
        self._ttft_stages = {stage: self.ttft_stages.labels(stage=stage) for stage in STAGES}
        self.step_seconds = Histogram("mmserve_decoder_step_seconds", "Engine step time",
                                      buckets=_LATENCY_BUCKETS, **kw)
        # Every field of the service's stats record (decoder_svc/stats.py), from the latest snapshot.
        self.latest: DecoderStats | None = None
        self.stats = StatsCollector("mmserve_decoder", lambda: self.latest, registry)

    def observe_ttft_stages(self, split: dict[str, float]) -> None:
        """Record one request's seconds per TTFT stage (decoder_svc/engine/ttft_stages.py)."""
        for stage, seconds in split.items():
            self._ttft_stages[stage].observe(seconds)

    def observe_stats(self, stats: DecoderStats) -> None:
        """Keep the newest stats record for the next scrape."""
        self.latest = stats
