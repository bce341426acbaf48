"""Prometheus metrics of one encoder: its stats record (encoder_svc/stats.py), read at scrape time, plus
the Encode latency histogram.

Collectors (not module-level metrics) so that several encoders in one process (tests) each report their
own numbers and unregister on shutdown.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.registry import Collector

from common.stats_metrics import StatsCollector
from encoder_svc.stages import STAGES
from encoder_svc.stats import EncoderStats

_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Latency(Collector):
    def __init__(self, *histograms: Histogram) -> None:
        self.histograms = histograms

    def collect(self):
        for histogram in self.histograms:
            yield from histogram.collect()


class EncoderMetrics:
    """Registers the stats record's metrics and the latency and stage histograms on `registry`;
    `observe_encode` records one Encode's latency, `observe_stages` its split (encoder_svc/stages.py)."""

    def __init__(self, read_stats: Callable[[], EncoderStats],
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        self.encode_latency = Histogram(
            "mmserve_encoder_encode_latency_seconds", "Encode RPC latency", ["cache"],
            buckets=_LATENCY_BUCKETS, registry=None)
        # Resolved once: labels() costs as much as the hit path's cache lookup.
        self._latency = {True: self.encode_latency.labels(cache="hit"),
                         False: self.encode_latency.labels(cache="miss")}
        self.stage_latency = Histogram(
            "mmserve_encoder_stage_seconds", "Encode time per stage (receive, decode, queue, preprocess, "
            "tower, handoff: they add up to the Encode's latency)", ["stage"], buckets=_STAGE_BUCKETS,
            registry=None)
        self._stages = {stage: self.stage_latency.labels(stage=stage) for stage in STAGES}
        self._stats = StatsCollector("mmserve_encoder", read_stats, registry)
        self._latency_collector = _Latency(self.encode_latency, self.stage_latency)
        self._registry = registry
        if registry is not None:
            registry.register(self._latency_collector)

    def observe_encode(self, seconds: float, all_hits: bool) -> None:
        """Record one Encode; labelled by whether every image was a cache hit."""
        self._latency[all_hits].observe(seconds)

    def observe_stages(self, split: dict[str, float]) -> None:
        """Record one Encode's seconds per stage."""
        for stage, seconds in split.items():
            self._stages[stage].observe(seconds)

    def close(self) -> None:
        """Unregister from the registry."""
        self._stats.close()
        if self._registry is not None:
            self._registry.unregister(self._latency_collector)
            self._registry = None
