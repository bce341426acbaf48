"""Prometheus metrics of the decoder service."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DecoderMetrics:
    """TTFT, inter-token latency, prefix-cache and image counters, KV usage, queue sizes."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        kw = {"registry": registry}
        self.ttft = Histogram("mmserve_decoder_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, **kw)
        self.itl = Histogram("mmserve_decoder_inter_token_latency_seconds", "Time between output chunks",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.e2e = Histogram("mmserve_decoder_request_latency_seconds", "Whole request latency",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.requests = Counter("mmserve_decoder_requests", "Requests by how they ended", ["outcome"], **kw)
        self.step_seconds = Histogram("mmserve_decoder_step_seconds", "Engine step time",
                                      buckets=_LATENCY_BUCKETS, **kw)
        # With dns:/// encoders this follows replicas as they come, go or fail health checks; 0 means
        # every image fails with UNAVAILABLE.
        self.encoders = Gauge("mmserve_decoder_encoders", "Encoder addresses in the routing ring", **kw)
        self.gauges = {name: Gauge(f"mmserve_decoder_{name}", doc, **kw) for name, doc in (
            ("running", "Running requests"),
            ("waiting", "Waiting requests"),
            ("kv_blocks_used", "KV blocks held by requests"),
            ("kv_blocks_total", "KV blocks in the pool"),
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"),
            ("images_encoded", "Images fetched from an encoder"),
            ("images_encoder_cache_hits", "Images served from the encoder's cache"),
            ("images_skipped_by_kv_reuse", "Images never encoded because their KV was cached"),
            ("preemptions", "Requests preempted (recomputed later)"),
        )}

    def observe_stats(self, stats) -> None:
        """Copy an EngineStats snapshot into the gauges."""
        for name, gauge in self.gauges.items():
            attr = {"prefix_cache_queried_tokens": "prefix_queried_tokens",
                    "prefix_cache_hit_tokens": "prefix_hit_tokens"}.get(name, name)
            gauge.set(getattr(stats, attr))
