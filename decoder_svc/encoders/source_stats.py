"""The remote embedding source's counters (names as in the API's DecoderStats where it has them)."""

from __future__ import annotations

from dataclasses import dataclass

from common.stats import stat


@dataclass
class RemoteSourceStats:
    """What this decoder asked of its encoders (names as in the API's DecoderStats where it has them)."""

    embeddings_requested: int = stat("Image embeddings asked of an encoder")
    images_prefetched: int = stat("Images first asked for by lookahead, ahead of their prefill")
    lookahead_ready_at_prefill: int = stat("Prefetched images already ready when prefill reached them")
    lookahead_waited_at_prefill: int = stat("Prefetched images still encoding when prefill reached them")
    lookahead_boosted: int = stat("Prefetched images raised to demand priority when their prefill came")
    encoder_busy_waits: int = stat("Waits past an Encode's attempt timeout because its encoder was busy, "
                                   "not unreachable (it answered a stats call)")
    embeddings_from_encoder_cache: int = stat("Embeddings an encoder served from its cache")
    embeddings_retained_hits: int = stat("Embeddings this decoder still held from an earlier request "
                                         "with the same image (no encoder asked)")
    embeddings_retained_bytes: int = stat("Bytes of embeddings held for later requests "
                                          "(--embedding-retain-bytes)", "gauge")
    embeddings_retained_evictions: int = stat("Held embeddings dropped for newer ones")
    images_resent: int = stat("Images whose bytes had to follow their hash (the encoder did not have it)")
    embedding_failures: int = stat("Image embeddings that failed (the request failed with them)")
    active_leases: int = stat("Embedding leases this decoder holds now", "gauge")
    embedding_transports: dict[str, int] = stat("Embeddings received, by transport", "labels",
                                                label="transport")
    encoders: int = stat("Encoder addresses in the routing ring (0: every image fails with UNAVAILABLE)",
                         "gauge")
