"""Prometheus metrics of one encoder: counters read from the cache at scrape time, plus latency.

A collector (not module-level Counters) so that several encoders in one process (tests) each report
their own numbers and can unregister on shutdown.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EncoderMetrics(Collector):
    """Registers itself on `registry`; `observe_encode` records one Encode's latency."""

    def __init__(self, cache, worker, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._cache = cache
        self._worker = worker
        self.encode_latency = Histogram(
            "mmserve_encoder_encode_latency_seconds", "Encode RPC latency", ["cache"],
            buckets=_LATENCY_BUCKETS, registry=None)
        # Resolved once: labels() costs as much as the hit path's cache lookup.
        self._latency = {True: self.encode_latency.labels(cache="hit"),
                         False: self.encode_latency.labels(cache="miss")}
        self._registry = registry
        if registry is not None:
            registry.register(self)

    def observe_encode(self, seconds: float, all_hits: bool) -> None:
        """Record one Encode; labelled by whether every image was a cache hit."""
        self._latency[all_hits].observe(seconds)

    def collect(self):
        s = self._cache.stats()
        for name, doc, value in (
            ("mmserve_encoder_cache_hits", "Embedding cache hits", s.hits),
            ("mmserve_encoder_cache_misses", "Embedding cache misses", s.misses),
            ("mmserve_encoder_cache_evictions", "Embedding cache evictions", s.evictions),
            ("mmserve_encoder_expired_leases", "Leases that expired unreleased", s.expired_leases),
            ("mmserve_encoder_inflight_dedups", "Requests that joined a running encode", s.inflight_dedups),
            ("mmserve_encoder_images_encoded", "Images run through the vision tower", self._worker.encodes),
            # images_encoded / vision_batches is the mean batch: it follows the queue up to --max-batch-images
            ("mmserve_encoder_vision_batches", "Vision-tower batches run", self._worker.batches),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("mmserve_encoder_cache_bytes_used", "Arena bytes holding entries", s.bytes_used),
            ("mmserve_encoder_cache_bytes_capacity", "Arena capacity in bytes", s.capacity),
            ("mmserve_encoder_cache_leased_bytes", "Bytes pinned by leases", s.leased_bytes),
            ("mmserve_encoder_cache_entries", "Cached embeddings", s.entries),
            ("mmserve_encoder_active_leases", "Leases held now", s.active_leases),
            ("mmserve_encoder_queue_depth", "Images waiting for the vision tower", self._worker.queued()),
            ("mmserve_encoder_cuda_graphs", "1 when demand batches replay CUDA graphs of the tower",
             int(getattr(self._worker.vision, "graphs", None) is not None)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self.encode_latency.collect()

    def close(self) -> None:
        """Unregister from the registry."""
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None
