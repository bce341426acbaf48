"""`mmserve encoder` / `python -m encoder_svc`: start the encoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common.cli import (
    UsageError,
    check_port_free,
    dtype_name,
    model_dir,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    report_usage_error,
    resolve_model_arg,
    start_listening,
)
from common.images import ImageLimits
from common.pb import encoder_pb2_grpc
from common.security.options import add_server_args, server_security_from_args
from common.server import GrpcService, configure_logging
from encoder_svc.defaults import DEFAULT_MAX_BATCH_IMAGES, PREPROCESS_MODES

log = logging.getLogger("mmserve.encoder")


def build_arg_parser() -> argparse.ArgumentParser:
    """The encoder's command-line options."""
    p = argparse.ArgumentParser(prog="mmserve encoder", description="LLaVA vision encoder service")
    p.add_argument("--model", type=model_dir, required=True,
                   help="LLaVA checkpoint: a directory, or a Hugging Face Hub id (found in the HF cache, "
                   "else downloaded unless HF_HUB_OFFLINE=1)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit for a Hub id --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=50051, help="0 picks a free port")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", type=dtype_name, default="float32", help="float32, float16 or bfloat16")
    p.add_argument("--cache-bytes", type=positive_int, default=1 << 30, help="embedding cache (arena) size")
    p.add_argument("--lease-ttl", type=positive_float, default=60.0,
                   help="seconds before an unreleased lease expires")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="Prometheus /metrics port (off if unset)")
    p.add_argument("--max-batch-images", "--max-batch-size", dest="max_batch_images", type=positive_int,
                   default=DEFAULT_MAX_BATCH_IMAGES,
                   help="most images per vision-tower batch; batches follow the queue up to it "
                   "(--max-batch-size is the old name)")
    p.add_argument("--preprocess", default="auto", choices=list(PREPROCESS_MODES),
                   help="hf: the checkpoint's HF image processor in CPU threads (exact); torch: resize, "
                   "crop and normalise with torch ops on --device (identical to hf without resampling, "
                   "else a few uint8 levels off: encoder_svc/pixels.py); "
                   "auto: torch on CUDA in bfloat16/float16, else hf")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs of the vision tower (on CUDA, demand batches replay graphs "
                   "captured at startup for 1, 2, 4, ... --max-batch-images images)")
    p.add_argument("--preprocess-threads", type=positive_int, default=None,
                   help="threads preparing images off the tower's thread (default: cores - 1, at most 16)")
    p.add_argument("--decode-processes", type=non_negative_int, default=None,
                   help="processes decoding and hashing image bytes off the server's interpreter "
                   "(default: cores - 1, at most 8, and 0 below 4 cores; 0: in the server's threads)")
    p.add_argument("--max-images-per-request", type=positive_int, default=ImageLimits.max_images_per_request)
    p.add_argument("--max-image-side", type=positive_int, default=ImageLimits.max_side, help="pixels")
    p.add_argument("--arena", default="auto", choices=["auto", "shm", "cuda", "private"],
                   help="where embeddings live: auto picks cuda (GPU + cupy), else shm, else private")
    add_server_args(p)
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace):
    """EncoderConfig from parsed arguments."""
    from common.checkpoint import parse_dtype
    from encoder_svc.server import EncoderConfig

    return EncoderConfig(
        model=args.model, device=args.device, dtype=parse_dtype(args.dtype), cache_bytes=args.cache_bytes,
        lease_ttl_s=args.lease_ttl, max_batch_images=args.max_batch_images, arena=args.arena,
        preprocess=args.preprocess, preprocess_threads=args.preprocess_threads,
        decode_processes=args.decode_processes,
        enforce_eager=args.enforce_eager,
        limits=ImageLimits(max_side=args.max_image_side, max_images_per_request=args.max_images_per_request))


async def serve(args: argparse.Namespace) -> None:
    """Load, bind, warm up, report SERVING, run until SIGTERM/SIGINT, then shut down cleanly."""
    from encoder_svc.server import SERVICE_NAME, EncoderServicer

    try:
        servicer = await asyncio.to_thread(EncoderServicer.build, config_from_args(args))
    except ValueError as exc:
        # build's ValueErrors are about the options or the checkpoint (a cache that cannot hold one
        # embedding, not a LLaVA checkpoint, weights that do not match): the user's to fix.
        raise UsageError(str(exc)) from None
    service = GrpcService("encoder", args.host, args.port, args.metrics_port,
                          security=getattr(args, "security", None))
    service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, SERVICE_NAME)
    try:
        port = await start_listening(service)
        await servicer.warm_up()
        service.set_serving(True)
        log.info("encoder ready on %s:%d (%s, %s, arena %s)", args.host, port, servicer.vision.device,
                 servicer.vision.dtype, type(servicer.cache.arena).__name__)
        await service.wait(on_shutdown=servicer.close)
    finally:
        if not servicer.closing:
            await servicer.close()


def run(args: argparse.Namespace) -> int:
    """Run the encoder until a signal; returns the exit code."""
    configure_logging(args.log_level)
    asyncio.run(serve(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run; a user error is one line on stderr and exit code 2."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        # Before the model loads: a busy port fails now, not after seconds (minutes for 7B) of loading.
        args.security = server_security_from_args(args)
        check_port_free(args.host, args.port)
        if args.metrics_port is not None:
            check_port_free(args.metrics_host, args.metrics_port, "--metrics-port")
        resolve_model_arg(args)  # after the port checks: a download can take minutes
        return run(args)
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
