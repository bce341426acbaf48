"""`mmserve encoder` / `python -m encoder_svc`: start the encoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common import event_loop
from common.config import add_options, add_print_config, config_json, from_args
from common.devices import resolve_dtype
from common.errors import UsageError
from common.pb import encoder_pb2_grpc
from common.security.options import ServerSecurity, add_server_args, server_security_from_args
from common.server import GrpcService, configure_logging
from common.startup import check_port_free, report_usage_error, resolve_checkpoint, start_listening
from encoder_svc.config import EncoderServiceConfig
from encoder_svc.memory_return import limit_malloc_arenas
from encoder_svc.stall import watch_tower

log = logging.getLogger("mmserve.encoder")
_STATS_LOG_INTERVAL_S = 10.0


def build_arg_parser() -> argparse.ArgumentParser:
    """The encoder's command-line options: EncoderServiceConfig's fields, then the security flags."""
    p = argparse.ArgumentParser(prog="mmserve encoder", description="vision encoder service")
    add_options(p, EncoderServiceConfig)
    add_server_args(p)
    add_print_config(p)
    return p


async def serve(config: EncoderServiceConfig, security: ServerSecurity | None = None) -> None:
    """Load, bind, warm up, report SERVING, run until SIGTERM/SIGINT, then shut down cleanly."""
    from encoder_svc.refs import transport_names
    from encoder_svc.server import SERVICE_NAME, EncoderServicer

    try:
        servicer = await asyncio.to_thread(EncoderServicer.build, config.encoder)
    except ValueError as exc:
        # build's ValueErrors are about the options or the checkpoint (a cache that cannot hold one
        # embedding, not a LLaVA checkpoint, weights that do not match): the user's to fix.
        raise UsageError(str(exc)) from None
    service = GrpcService("encoder", config.service.host, config.port, config.service.metrics_port,
                          security=security)
    service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, SERVICE_NAME)
    try:
        port = await start_listening(service)
        await servicer.warm_up()
        service.set_serving(True)
        transports = transport_names(servicer.served)
        log.info("encoder ready on %s:%d (%s, %s, arena %s, transports %s, %s loop)", config.service.host,
                 port, servicer.vision.device, servicer.vision.dtype, type(servicer.cache.arena).__name__,
                 transports, event_loop.running_kind())
        logger = asyncio.create_task(_log_stats(servicer))
        watchdog = asyncio.create_task(watch_tower(
            servicer.worker.stalled_for_s, config.encoder.stall_exit_s, lambda: service.set_serving(False)))
        try:
            await service.wait(on_shutdown=servicer.close)
        finally:
            logger.cancel()
            watchdog.cancel()
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run until a signal; a user error is one line on stderr and exit code 2."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(EncoderServiceConfig, args)  # the config's own checks, before anything loads
    except ValueError as exc:  # one line, e.g. --device cuda on a CPU build of torch
        return report_usage_error(parser.prog, exc)
    if args.print_config:
        print(config_json(config))
        return 0
    limit_malloc_arenas()  # before any thread allocates: trims give bursts' memory back (memory_return.py)
    try:
        # Before the model loads: a busy port fails now, not after seconds (minutes for 7B) of loading.
        security = server_security_from_args(args)
        try:
            event_loop.loop_kind()  # $MMSERVE_EVENT_LOOP: a bad value is a usage error, now
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        check_port_free(config.service.host, config.port)
        if config.service.metrics_port is not None:
            check_port_free(security.metrics_host, config.service.metrics_port, "--metrics-port")
        # After the port checks: a download can take minutes.
        config.encoder.model = resolve_checkpoint(config.encoder.model, config.service.revision)
        c = config.encoder
        c.dtype = resolve_dtype(c.dtype, c.device, c.model)  # auto: a Hub id's snapshot is here now
        configure_logging(config.service.log_level)
        event_loop.run(serve(config, security))
        return 0
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
