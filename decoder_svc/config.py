"""The decoder service's configuration tree; its command line is generated from it (common/config.py).

    DecoderConfig
      engine: EngineConfig        the model, KV cache, batching and kernels (decoder_svc/engine/engine.py)
      encoders: EncoderLinkConfig  where the encoders are and how long to wait for them
      service: ServiceOptions      host, metrics port, log level, Hub revision (common/config.py)
      port, drain_timeout_s        the gRPC server

Security flags (TLS, tokens) are their own set, shared with the encoder: common/security/options.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.arg_types import non_negative_int, port_number, positive_float
from common.config import ServiceOptions, check_options, option, section
from decoder_svc.engine.config import EngineConfig

EMBEDDING_TRANSPORTS = ("cuda_ipc", "shm", "nixl", "inline")


def transport_names(text: str) -> str:
    """An argparse type: a comma-separated list of embedding transports ("nixl,inline"), normalised."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in EMBEDDING_TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected transports from {','.join(EMBEDDING_TRANSPORTS)}, "
                                         f"comma-separated, not {text!r}")
    return ",".join(names)


@dataclass
class EncoderLinkConfig:
    """The encoders this decoder fetches embeddings from."""

    addresses: list[str] = option(
        help="encoder address (repeat for several: images are routed by consistent hash), or "
        "dns:///NAME:PORT for every address behind NAME (e.g. a headless Service), re-resolved every "
        "--encoder-resolve-interval seconds", flag="--encoder", metavar="HOST:PORT", append=True,
        default_factory=list)
    resolve_interval_s: float = option(
        5.0, "seconds between DNS lookups and health checks of dns:/// encoders",
        flag="--encoder-resolve-interval", type=positive_float)
    timeout_s: float = option(
        20.0, "seconds from an image's first ask until an unreachable encoder fails the request "
        "(UNAVAILABLE)", flag="--encoder-timeout", type=positive_float)
    send_ahead: bool = option(
        True, "no sending of a new image file to its encoder as its request arrives (the engine then "
        "sends it when the encoder answers its ask by hash NOT_FOUND)", flag="--no-send-ahead")
    retain_bytes: int = option(
        256 << 20, "bytes of image embeddings kept after their requests end, for the next request with the "
        "same image (a follow-up question: no Encode round trip), least recently used dropped first; on the "
        "decoder's device, outside the KV cache's budget (0: none kept)", flag="--embedding-retain-bytes",
        type=non_negative_int, metavar="BYTES")
    transports: str | None = option(
        None, "embedding transports to ask encoders for, best first, comma-separated from cuda_ipc, shm, "
        "nixl, inline (default: every one this process can read, in that order; inline is always the "
        "last resort). E.g. nixl to READ over NIXL from an encoder on this host too",
        flag="--embedding-transports", type=transport_names, metavar="LIST")

    @property
    def transport_list(self) -> list[str] | None:
        """--embedding-transports as names, or None for the default (every readable one)."""
        return transport_names(self.transports).split(",") if self.transports else None

    def __post_init__(self) -> None:
        check_options(self)
        from decoder_svc.encoders.discovery import parse_dns_target

        for spec in self.addresses:
            try:
                parse_dns_target(spec)
            except ValueError as exc:
                raise ValueError(f"--encoder {exc}") from None


@dataclass
class DecoderConfig:
    """Everything `mmserve decoder` is started with, but security."""

    engine: EngineConfig = section(EngineConfig, "engine")
    encoders: EncoderLinkConfig = section(EncoderLinkConfig, "encoders")
    service: ServiceOptions = section(ServiceOptions, "service")
    port: int = option(50052, "gRPC port (0 picks a free one)", type=port_number)
    drain_timeout_s: float = option(
        30.0, "on SIGTERM, seconds in-flight streams may take to finish (new ones get UNAVAILABLE)",
        flag="--drain-timeout", type=positive_float)
    step_trace: str | None = option(
        None, "append one JSON line per engine step to FILE (start, seconds, tokens, queue lengths, "
        "commands handled before it): for profiling, decoder_svc/step_trace.py", metavar="FILE")

    def __post_init__(self) -> None:
        check_options(self)
        if not self.encoders.addresses:
            raise ValueError("give at least one --encoder HOST:PORT (or dns:///NAME:PORT)")
