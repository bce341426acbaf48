"""Service counters before and after a run, and the cache hit rates computed from their difference."""

from __future__ import annotations

from bench.stats import ratio
from common.client import DecoderClient, EncoderClient


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def decoder_stats(address: str) -> dict:
    """The decoder's GetStats as a dict."""
    with DecoderClient(address, timeout=10) as client:
        return _fields(client.stats())


def encoder_stats(address: str) -> dict:
    """The encoder's GetStats as a dict."""
    with EncoderClient(address, timeout=10) as client:
        return _fields(client.stats())


def stage_split(before: dict, after: dict, sums: str = "ttft_stage_seconds",
                calls: str = "ttft_calls") -> dict:
    """Mean ms per stage between two stats snapshots (dicts of GetStats fields): the decoder's TTFT split
    by default, the encoder's Encode split with sums="stage_seconds", calls="encode_calls"."""
    n = int(after.get(calls, 0)) - int(before.get(calls, 0))
    s0, s1 = dict(before.get(sums, {})), dict(after.get(sums, {}))
    return {k: round((v - s0.get(k, 0.0)) * 1000 / n, 2) for k, v in s1.items()} if n > 0 else {}


def delta(before: dict, after: dict) -> dict:
    """after - before for every numeric counter."""
    return {k: after[k] - before[k] for k in after
            if isinstance(after[k], (int, float)) and not isinstance(after[k], bool) and k in before}


def decoder_cache_metrics(d: dict) -> dict:
    """Prefix-cache hit rate (tokens), images skipped by KV reuse, lookahead counters, from a delta."""
    return {
        "prefix_cache_hit_rate": ratio(d.get("prefix_cache_hit_tokens", 0),
                                       d.get("prefix_cache_queried_tokens", 0)),
        "prefix_cache_hit_tokens": d.get("prefix_cache_hit_tokens", 0),
        "prefix_cache_queried_tokens": d.get("prefix_cache_queried_tokens", 0),
        "images_encoded": d.get("images_encoded", 0),
        "images_encoder_cache_hits": d.get("images_encoder_cache_hits", 0),
        "images_skipped_by_kv_reuse": d.get("images_skipped_by_kv_reuse", 0),
        "images_prefetched": d.get("images_prefetched", 0),
        "lookahead_ready_at_prefill": d.get("lookahead_ready_at_prefill", 0),
        "lookahead_waited_at_prefill": d.get("lookahead_waited_at_prefill", 0),
        "preemptions": d.get("preemptions", 0),
    }


def encoder_cache_metrics(d: dict) -> dict:
    """Encoder embedding-cache hit rate hits / (hits + misses), from a delta."""
    hits, misses = d.get("hits", 0), d.get("misses", 0)
    return {"encoder_cache_hit_rate": ratio(hits, hits + misses), "encoder_hits": hits,
            "encoder_misses": misses, "encoder_tower_encodes": d.get("encodes", 0),
            "encoder_inflight_dedups": d.get("inflight_dedups", 0)}


class StatsWindow:
    """Snapshot both services' counters at open and report the cache metrics of the window at close."""

    def __init__(self, decoder: str | None, encoder: str | None = None) -> None:
        self.decoder, self.encoder = decoder, encoder
        self._d0 = decoder_stats(decoder) if decoder else None
        self._e0 = encoder_stats(encoder) if encoder else None

    def close(self) -> dict:
        """Cache metrics since the window opened (encoder ones only when an encoder was given)."""
        out: dict = {}
        if self.decoder:
            out.update(decoder_cache_metrics(delta(self._d0, decoder_stats(self.decoder))))
        if self.encoder:
            out.update(encoder_cache_metrics(delta(self._e0, encoder_stats(self.encoder))))
        return out
