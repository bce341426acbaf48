"""The gateway's configuration tree; `mmserve gateway`'s flags are generated from it (common/config.py).

    GatewayConfig
      images: ImageFetchPolicy     what image URLs may cost: sizes, counts, fetch concurrency, formats
      limits: RequestLimits        what a request may carry before any work is done on it
      http: HttpServerLimits       connections: header and body read timeouts, connection cap
      upstream: ClientSecurity     TLS and token towards the decoders (common/security/options.py flags)

Every default is defined here once; the command line shows it in --help.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from common.arg_types import int_in_range, port_number, positive_float, positive_int
from common.arg_types import model_dir as model_arg
from common.config import check_options, option, section
from common.images import DEFAULT_IMAGE_FORMATS, image_format_list
from common.lora_modules import LoRAModule, lora_modules_by_name
from common.security.options import ClientSecurity
from common.server import DEFAULT_MAX_MESSAGE_BYTES
from gateway.discovery import check_target
from gateway.media_memo import DEFAULT_MAX_TENANTS
from gateway.model_info import default_served_names
from gateway.routing import ROUTING_POLICIES

# The decoder's own limit on cache_salt (decoder_svc/engine/input_processor.py MAX_SALT_BYTES), which it
# checks after every prefix is applied: the gateway's tenant prefix, and the decoder's tenant namespace
# (`mmserve-tenant:<name>:`, name at most 64 characters) when the gateway authenticates with a token.
DECODER_MAX_SALT_BYTES = 256
UPSTREAM_TENANT_PREFIX_BYTES = len("mmserve-tenant:") + 64 + 1
# Room in the upstream gRPC message for everything but image bytes (text, protobuf framing).
UPSTREAM_MESSAGE_MARGIN = 8 * 2**20


@dataclass(frozen=True)
class ImageFetchPolicy:
    """Limits on the images and videos a request may name, checked before any fetch (a video URL is fetched
    like an image URL: the same timeout, address rules and per-request byte limit; its own per-file one)."""

    max_bytes: int = option(20 * 2**20, "largest image (URL body or data URL), bytes",
                            flag="--max-image-bytes", type=positive_int)
    max_video_bytes: int = option(128 * 2**20, "largest video (URL body or data URL), bytes (the encoder's "
                                  "own --max-video-bytes applies too)", flag="--max-video-bytes",
                                  type=positive_int)
    timeout_s: float = option(10.0, "seconds per image URL", flag="--image-fetch-timeout",
                              type=positive_float)
    allow_private: bool = option(False, "also fetch image URLs on loopback, private and link-local "
                                 "addresses", flag="--allow-private-image-urls")
    max_images_per_request: int = option(16, "most images in one request (the decoder's default limit)",
                                         type=positive_int)
    max_videos_per_request: int = option(4, "most videos (video_url parts) in one request; their URLs are "
                                         "fetched under the same rules as images", type=positive_int)
    max_total_image_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES - UPSTREAM_MESSAGE_MARGIN,
        "most image bytes in one request, all images together: must fit the decoder's gRPC message "
        "(beyond it: 413)", type=positive_int)
    max_bytes_in_flight: int = option(
        512 * 2**20, "most image and video bytes the whole gateway holds for the requests in flight, "
        "each request's counted once whatever its n (beyond it: 429 with Retry-After); at least "
        "--max-total-image-bytes", flag="--max-image-bytes-in-flight", type=positive_int)
    max_images_all_choices: int = option(
        64, "most images and videos of one request counted once per choice (n x per choice): the "
        "decoder's input processing takes 64 at once, so more could never be admitted together "
        "(beyond it: 400)", type=positive_int)
    max_named_media_bytes: int = option(
        64 * 2**20, "most bytes of images and videos the gateway remembers by their parts' `uuid` (vLLM's), "
        "per tenant (API key), so that a later part may name them without the file (0: remember none)",
        flag="--max-uuid-media-bytes", type=int_in_range(0))
    max_named_media_tenants: int = option(
        DEFAULT_MAX_TENANTS, "most tenants whose `uuid` files the gateway remembers at once, "
        "--max-uuid-media-bytes each: a new tenant's file makes the least recently active tenant's files "
        "forgotten", flag="--max-uuid-media-tenants", type=positive_int)
    fetch_concurrency: int = option(4, "image URLs fetched at once for one request",
                                    flag="--image-fetch-concurrency", type=positive_int)
    global_fetch_concurrency: int = option(64, "image URLs fetched at once by the whole gateway",
                                           flag="--image-fetch-global-concurrency", type=positive_int)
    formats: str = option(",".join(DEFAULT_IMAGE_FORMATS), "image formats accepted, checked from the "
                          "file header before anything is decoded", flag="--image-formats",
                          type=image_format_list)

    def __post_init__(self) -> None:
        check_options(self)
        if self.max_bytes_in_flight < self.max_total_image_bytes:  # else a request could never fit
            raise ValueError(f"--max-image-bytes-in-flight ({self.max_bytes_in_flight}) must be at least "
                             f"--max-total-image-bytes ({self.max_total_image_bytes})")

    def max_file_bytes(self, kind: str) -> int:
        """The per-file limit of an image or (kind "video") a video."""
        return self.max_video_bytes if kind == "video" else self.max_bytes

    @property
    def format_names(self) -> tuple[str, ...]:
        return tuple(image_format_list(self.formats).split(","))


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry; each is checked before any fetch, template or upstream call."""

    max_request_bytes: int = option(64 * 2**20, "largest request body, bytes (beyond it: 413)",
                                    type=positive_int)
    max_json_values: int = option(100_000, "most JSON objects and numbers in a body (beyond it: 413)",
                                  type=positive_int)
    max_messages: int = option(1024, "most chat messages in a request", type=positive_int)
    max_content_parts: int = option(2048, "most content parts in a request, all messages together",
                                    type=positive_int)
    max_prompt_bytes: int = option(2**20, "largest rendered prompt, bytes: text plus each message's "
                                   "template overhead (the decoder's default limit)", type=positive_int)
    parse_off_loop_bytes: int = option(256 * 2**10, "bodies larger than this are parsed in a worker "
                                       "thread, one at a time, so the event loop keeps serving",
                                       type=positive_int)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class HttpServerLimits:
    """Connection handling of the HTTP server (uvicorn's settings where it has them)."""

    header_timeout_s: float = option(10.0, "seconds a client has to send a request's headers (then the "
                                     "connection is closed)", flag="--header-timeout", type=positive_float)
    body_timeout_s: float = option(60.0, "seconds a client has to send a request's body (then 408)",
                                   flag="--body-timeout", type=positive_float)
    keep_alive_s: int = option(5, "seconds an idle keep-alive connection stays open (uvicorn's "
                               "timeout_keep_alive)", flag="--keep-alive-timeout", type=positive_int)
    max_connections: int = option(2048, "open connections and requests at once; beyond it new requests "
                                  "get 503 (uvicorn's limit_concurrency)", type=positive_int)
    max_header_bytes: int = option(64 * 2**10, "largest request head, bytes (h11's incomplete-event "
                                   "limit)", type=positive_int)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class GatewayConfig:
    """Everything `mmserve gateway` is started with."""

    decoders: list[str] = option(help="a decoder's gRPC address (repeatable: balanced by least outstanding "
                                 "requests), dns:///NAME:PORT for every address behind NAME, or file:PATH "
                                 "for the HOST:PORT lines of a file; both looked at again every "
                                 "--decoder-check-interval seconds", flag="--decoder", metavar="HOST:PORT",
                                 append=True, default_factory=list)
    decoder_check_interval_s: float = option(2.0, "seconds between health checks of the decoders (and "
                                             "lookups of dns:/// and file: targets)",
                                             flag="--decoder-check-interval", type=positive_float)
    routing: str = option("least-outstanding", "how a request's decoder is chosen: least-outstanding "
                          "(fewest requests open there), or cache-aware (where its prefix and images were "
                          "sent lately, within a load slack; the `user` field as a fallback; "
                          "gateway/routing.py)", choices=ROUTING_POLICIES)
    host: str = option("127.0.0.1", "bind address")
    port: int = option(8000, "HTTP port", type=port_number)
    served_model_names: list[str] = option(
        help="the model name(s) clients send and /v1/models lists; responses carry the first (default: "
        "--model as typed, and for a directory also its name; else 'mmserve')", flag="--served-model-name",
        metavar="NAME", append=True, nargs="+", default_factory=list)
    lora_modules: list[str] = option(
        help="LoRA adapters the decoders serve (their --lora-modules): a request whose `model` is one of "
        "these names runs with that adapter, and /v1/models lists them (PATH, if given, is only listed as "
        "the card's root); vLLM's JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
        "too (base_model_name: the card's parent). A name given twice is refused",
        flag="--lora-modules", metavar="NAME[=PATH]", append=True, nargs="+",
        default_factory=list)
    model: Path | str | None = option(
        None, "the served checkpoint dir: its tokenizer writes logprob tokens as text (without it they "
        "read token_id:N)", flag="--model", type=model_arg)
    api_keys: list[str] = option(help="accept this bearer key (repeatable; also $MMSERVE_API_KEY); each key "
                                 "is a tenant with its own prefix and embedding cache. Default: no "
                                 "authentication", flag="--api-key", append=True, default_factory=list)
    request_timeout_s: float = option(600.0, "deadline of each decoder call in seconds (then 504)",
                                      flag="--request-timeout", type=positive_float)
    decoder_retries: int = option(1, "times a request whose decoder went away (UNAVAILABLE, a broken "
                                  "connection) before anything of it reached the client is started again "
                                  "on another healthy decoder, within --request-timeout (0: never)",
                                  type=int_in_range(0, 8))
    cache_salt_header: str = option("x-cache-salt", "request header that may split a tenant's cache")
    log_level: str = option("INFO", "DEBUG, INFO, WARNING or ERROR")
    images: ImageFetchPolicy = section(ImageFetchPolicy, "image URLs")
    limits: RequestLimits = section(RequestLimits, "request limits")
    http: HttpServerLimits = section(HttpServerLimits, "HTTP connections")
    upstream: ClientSecurity = field(default_factory=ClientSecurity)  # flags: common/security/options.py

    def __post_init__(self) -> None:
        check_options(self)
        if not self.decoders:
            raise ValueError("--decoder: give at least one decoder address")
        for spec in self.decoders:
            check_target(spec)
        if not self.served_model_names:
            self.served_model_names = default_served_names(self.model)
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("--served-model-name: a name is given twice")
        also_served = [name for name in self.lora_adapters if name in self.served_model_names]
        if also_served:
            raise ValueError(f"--lora-modules: adapter {also_served[0]!r} is also a --served-model-name")
        if self.model is not None:
            self.model = Path(self.model)

    @property
    def lora_adapters(self) -> dict[str, LoRAModule]:
        """{adapter name: LoRAModule}, in flag order (ValueError for a malformed item or a name twice)."""
        return lora_modules_by_name(self.lora_modules)

    @property
    def served_model_name(self) -> str:
        """The name responses carry: the first --served-model-name."""
        return self.served_model_names[0]

    def tenant_of(self, api_key: str) -> str:
        """A stable, non-secret name for an API key: the prefix of every cache salt its requests get, so
        that tenants with different keys never share prefix KV or embeddings."""
        return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]

    @property
    def max_salt_bytes(self) -> int:
        """The decoder's salt limit less what the gateway adds (tenant prefix) and, with a token upstream,
        less the decoder's tenant namespace: the longest salt a client may send."""
        reserve = len(self.tenant_of("x")) + 1 if self.api_keys else 0
        if self.upstream.token:
            reserve += UPSTREAM_TENANT_PREFIX_BYTES
        return DECODER_MAX_SALT_BYTES - reserve
