"""The encoder service's configuration tree; its command line is generated from it (common/config.py).

    EncoderServiceConfig
      encoder: EncoderConfig      the tower, the embedding cache, the workers
        limits: ImageLimits       what one request may carry (common/images.py)
        video_limits: VideoLimits the videos' caps, checked from their headers (common/video/limits.py)
      service: ServiceOptions     host, metrics port, log level, Hub revision
      port                        the gRPC server's

A light module (no torch): the command line checks its flags before anything heavy loads. Security
flags (TLS, tokens) are their own set, shared with the decoder: common/security/options.py.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from common.arg_types import (
    dtype_name,
    model_dir,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    require_local_weights,
)
from common.config import ServiceOptions, check_options, option, section
from common.devices import resolve_device_and_dtype
from common.images import ImageLimits
from common.video.limits import VideoLimits
from common.vision import PREPROCESS_MODES, VISION_QUANTIZATION
from encoder_svc.defaults import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_BATCH_IMAGES,
    DEFAULT_MAX_IMAGE_SECONDS,
    DEFAULT_SENT_AHEAD_CLAIM_S,
)

ARENAS = ("auto", "shm", "cuda", "private")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


@dataclass
class EncoderConfig:
    """Everything an encoder's tower, cache and workers start with."""

    model: str | Path = option(
        help="checkpoint of a served family: a directory, or a Hugging Face Hub id (in the HF cache, else "
        "downloaded unless HF_HUB_OFFLINE=1)", type=model_dir)
    device: str = option("auto", "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (the checkpoint's dtype on a GPU, float32 on CPU), float32, float16 or "
                        "bfloat16", type=dtype_name)
    cache_bytes: int = option(1 << 30, "embedding cache (arena) size in bytes", type=positive_int)
    lease_ttl_s: float = option(DEFAULT_LEASE_TTL_S, "seconds before an unreleased lease expires",
                                flag="--lease-ttl", type=positive_float)
    sent_ahead_claim_s: float = option(
        DEFAULT_SENT_AHEAD_CLAIM_S, "seconds a file that a decoder sent ahead is worked on for its request "
        "before that request asks for it: a file sent ahead belongs to its request, so its production stops "
        "once that request has ended (cancelling its ask) or not asked within this time, unless another "
        "request waits for it", flag="--sent-ahead-claim", type=positive_float)
    max_image_seconds: float = option(
        DEFAULT_MAX_IMAGE_SECONDS, "most seconds of vision tower one image may cost, estimated before any "
        "work from its size after resizing x the tower's measured cost so far (nothing is refused before "
        "the tower has run; an estimate, low for images far larger than those measured); over it the "
        "image is INVALID_ARGUMENT naming this flag (0: no cap)", flag="--max-image-seconds",
        type=non_negative_float)
    max_batch_images: int = option(
        DEFAULT_MAX_BATCH_IMAGES, "most images per vision-tower batch; batches follow the queue up to it "
        "(--max-batch-size is the old name)", aliases=("--max-batch-size",), type=positive_int)
    preprocess: str = option(
        "auto", "hf: the checkpoint's HF image processor in CPU threads (exact); torch: resize, crop and "
        "normalise with torch ops on --device (identical to hf without resampling, else a few uint8 "
        "levels off: common/vision/pixels.py); auto: torch on CUDA in bfloat16/float16, else hf",
        choices=PREPROCESS_MODES)
    preprocess_threads: int | None = option(
        None, "threads preparing images off the tower's thread (default: cores - 1, at most 16)",
        type=positive_int)
    decode_processes: int | None = option(
        None, "processes decoding and hashing image bytes off the server's interpreter (default: cores "
        "- 1, at most 8, and 0 below 4 cores; 0: in the server's threads)", type=non_negative_int)
    pool_decode_always: bool = option(
        False, "decode every image in the decode processes, also an image while no other is decoding "
        "(by default that one decodes in a server thread: about half its latency on an H200 host, without "
        "the processes' isolation from a crash in an image library)")
    vision_quantization: str = option(
        "none", "weights of the vision tower's linear layers: none (the --dtype's), or fp8 (e4m3, one scale "
        "per output channel, quantized at load; activations quantized per token; FP8 x FP8 products on a "
        "GPU's tensor cores); a family without an FP8 tower refuses it at start. Embeddings then differ from "
        "the --dtype tower's by the rounding (BENCHMARKS.md has the measured cosine)",
        choices=VISION_QUANTIZATION)
    deterministic: bool = option(
        False, "batch-invariant embeddings: every image (or video) through the tower in a forward of its "
        "own, and the attention kernel chosen by shape rather than by a timing, so that an image's embedding "
        "is the same bits whatever other images shared its batch, in this process or another on the same "
        "GPU model and software. Costs the batching's gain (BENCHMARKS.md: batch 1 against batch 8)")
    enforce_eager: bool = option(
        False, "no CUDA graphs of the vision tower (on CUDA, demand batches replay graphs: of a fixed-size "
        "tower, captured at startup for 1, 2, 4, ... --max-batch-images images; of a dynamic-resolution "
        "one, one graph per batch of image sizes seen twice)")
    stall_exit_s: float = option(
        120.0, "seconds the vision tower may owe work without a step (a batch running, or images queued and "
        "none taken) before the encoder counts itself stuck: it logs every thread's stack and exits (code "
        "1), so that its decoders fail over or retry and a supervisor restarts it, instead of holding their "
        "requests until their deadlines (a batch takes well under a second)", flag="--stall-exit",
        type=positive_float)
    arena: str = option("auto", "where embeddings live: auto picks cuda (GPU + cupy), else shm, else "
                        "private", choices=ARENAS)
    nixl: bool = option(
        False, "register the arena with a NIXL agent and offer the NIXL transport to decoders that ask for "
        "it (needs the nixl extra; without it the encoder logs why and serves the other transports). NIXL "
        "has no authentication: use it on a trusted data network only")
    limits: ImageLimits = section(ImageLimits, "image limits")
    video_limits: VideoLimits = section(VideoLimits, "video limits (models that take video), checked from "
                                        "the header before any frame is decoded")

    def __post_init__(self) -> None:
        check_options(self)
        require_local_weights(self.model)
        resolve_device_and_dtype(self)  # auto: cuda when torch sees a GPU; the checkpoint's dtype there


@dataclass
class EncoderServiceConfig:
    """Everything `mmserve encoder` is started with, but security."""

    encoder: EncoderConfig = section(EncoderConfig, "vision tower and cache")
    service: ServiceOptions = section(ServiceOptions, "service")
    port: int = option(50051, "gRPC port (0 picks a free one)", type=port_number)

    def __post_init__(self) -> None:
        check_options(self)
