"""`mmserve encoder` / `python -m encoder_svc`: start the encoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common import event_loop
from common.cli import UsageError, check_port_free, report_usage_error, resolve_model_arg, start_listening
from common.config import add_options, from_args
from common.pb import encoder_pb2_grpc
from common.security.options import add_server_args, server_security_from_args
from common.server import GrpcService, configure_logging
from encoder_svc.config import EncoderConfig, EncoderServiceConfig

log = logging.getLogger("mmserve.encoder")
_STATS_LOG_INTERVAL_S = 10.0


def build_arg_parser() -> argparse.ArgumentParser:
    """The encoder's command-line options: EncoderServiceConfig's fields, then the security flags."""
    p = argparse.ArgumentParser(prog="mmserve encoder", description="LLaVA vision encoder service")
    add_options(p, EncoderServiceConfig)
    add_server_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    """The encoder's configuration from parsed arguments (ValueError from its checks)."""
    return from_args(EncoderServiceConfig, args).encoder


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
        log.info("encoder ready on %s:%d (%s, %s, arena %s, %s loop)", args.host, port,
                 servicer.vision.device, servicer.vision.dtype, type(servicer.cache.arena).__name__,
                 event_loop.running_kind())
        logger = asyncio.create_task(_log_stats(servicer))
        try:
            await service.wait(on_shutdown=servicer.close)
        finally:
            logger.cancel()
    finally:
        if not servicer.closing:
            await servicer.close()


async def _log_stats(servicer) -> None:
    """Log the stats line every _STATS_LOG_INTERVAL_S while it changes."""
    last = ""
    while True:
        await asyncio.sleep(_STATS_LOG_INTERVAL_S)
        line = servicer.stats().log_line()
        if line != last:
            log.info("stats: %s", line)
            last = line


def run(args: argparse.Namespace) -> int:
    """Run the encoder until a signal; returns the exit code."""
    configure_logging(args.log_level)
    event_loop.run(serve(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run; a user error is one line on stderr and exit code 2."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        config_from_args(args)  # the config's own checks, before anything loads
    except ValueError as exc:
        parser.error(str(exc))
    try:
        # Before the model loads: a busy port fails now, not after seconds (minutes for 7B) of loading.
        args.security = server_security_from_args(args)
        try:
            event_loop.loop_kind()  # $MMSERVE_EVENT_LOOP: a bad value is a usage error, now
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        check_port_free(args.host, args.port)
        if args.metrics_port is not None:
            check_port_free(args.metrics_host, args.metrics_port, "--metrics-port")
        resolve_model_arg(args)  # after the port checks: a download can take minutes
        return run(args)
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
