"""`mmserve encoder` / `python -m encoder_svc`: start the encoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common.checkpoint import parse_dtype
from common.images import ImageLimits
from common.pb import encoder_pb2_grpc
from common.server import GrpcService, configure_logging

log = logging.getLogger("mmserve.encoder")


def build_arg_parser() -> argparse.ArgumentParser:
    """The encoder's command-line options."""
    p = argparse.ArgumentParser(prog="mmserve encoder", description="LLaVA vision encoder service")
    p.add_argument("--model", required=True, help="Hugging Face LLaVA checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    p.add_argument("--cache-bytes", type=int, default=1 << 30, help="embedding cache (arena) size")
    p.add_argument("--lease-ttl", type=float, default=60.0, help="seconds before an unreleased lease expires")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)")
    p.add_argument("--max-batch-size", type=int, default=8, help="images per vision-tower batch")
    p.add_argument("--max-images-per-request", type=int, default=ImageLimits.max_images_per_request)
    p.add_argument("--max-image-side", type=int, default=ImageLimits.max_side, help="pixels")
    p.add_argument("--arena", default="auto", choices=["auto", "shm", "cuda", "private"],
                   help="where embeddings live: auto picks cuda (GPU + cupy), else shm, else private")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace):
    """EncoderConfig from parsed arguments."""
    from encoder_svc.server import EncoderConfig

    return EncoderConfig(
        model=args.model, device=args.device, dtype=parse_dtype(args.dtype), cache_bytes=args.cache_bytes,
        lease_ttl_s=args.lease_ttl, max_batch_size=args.max_batch_size, arena=args.arena,
        limits=ImageLimits(max_side=args.max_image_side, max_images_per_request=args.max_images_per_request))


async def serve(args: argparse.Namespace) -> None:
    """Load, bind, warm up, report SERVING, run until SIGTERM/SIGINT, then shut down cleanly."""
    from encoder_svc.server import SERVICE_NAME, EncoderServicer

    servicer = await asyncio.to_thread(EncoderServicer.build, config_from_args(args))
    service = GrpcService("encoder", args.host, args.port, args.metrics_port)
    service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, SERVICE_NAME)
    try:
        port = await service.start()
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
    """Parse argv and run."""
    return run(build_arg_parser().parse_args(argv))
