"""Prometheus metrics of the gateway, in a registry of its own (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# TTFT through the gateway spans image fetch, queueing and prefill: from milliseconds to minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """Requests by endpoint and HTTP status, errors by code, TTFT and E2E, tokens, decoder load."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmserve_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("mmserve_gateway_errors", "failed requests by HTTP status and error code",
                              ["status", "code"], registry=r)
        self.ttft = Histogram("mmserve_gateway_ttft_seconds", "request arrival to first token",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mmserve_gateway_e2e_seconds", "request arrival to last token",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mmserve_gateway_prompt_tokens", "prompt tokens", registry=r)
        self.cached_prompt_tokens = Counter(
            "mmserve_gateway_cached_prompt_tokens", "prompt tokens served from the decoder's prefix cache",
            registry=r)
        self.completion_tokens = Counter("mmserve_gateway_completion_tokens", "generated tokens", registry=r)
        self.disconnects = Counter("mmserve_gateway_client_disconnects",
                                   "requests whose client went away before the end (the call is cancelled)",
                                   registry=r)
        self.decoder_retries = Counter(
            "mmserve_gateway_decoder_retries", "requests sent to another decoder before anything reached the "
            "client: `failover` a call refused UNAVAILABLE before its first message, `restart` a request "
            "started again after its decoder went away", ["kind"], registry=r)
        self.outstanding = Gauge("mmserve_gateway_decoder_outstanding", "open requests per decoder",
                                 ["decoder"], registry=r)

        self.media_bytes_held = Gauge(
            "mmserve_gateway_media_bytes_held", "image and video bytes held for the requests in flight, "
            "each request's once (--max-image-bytes-in-flight)", registry=r)

    def observe_usage(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(cached)
        self.completion_tokens.inc(completion)
