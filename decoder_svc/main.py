"""`mmserve decoder`: start the decoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence

from common import event_loop
from common.config import add_options, add_print_config, config_json, from_args
from common.devices import resolve_dtype
from common.errors import UsageError
from common.pb import decoder_pb2_grpc
from common.security.options import (
    ClientSecurity,
    ServerSecurity,
    add_client_args,
    add_server_args,
    client_security_from_args,
    server_security_from_args,
)
from common.server import GrpcService, configure_logging
from common.startup import check_port_free, report_usage_error, resolve_checkpoint, start_listening
from common.transport.importer import accepted_transports, transport_list_names
from decoder_svc.config import DecoderConfig

log = logging.getLogger("mmserve.decoder")
_STATS_LOG_INTERVAL_S = 10.0  # the stats line is logged at most this often, and only when it changed


def accepted(config: DecoderConfig) -> list[int]:
    """The embedding transports this decoder asks for (UsageError for one it cannot read)."""
    try:
        return accepted_transports(config.encoders.transport_list, config.engine.device)
    except ValueError as exc:
        raise UsageError(f"--embedding-transports: {exc}") from None


def build_arg_parser() -> argparse.ArgumentParser:
    """The decoder's command-line options: DecoderConfig's fields, then the security flags."""
    p = argparse.ArgumentParser(prog="mmserve decoder", description="decoder service")
    add_options(p, DecoderConfig)
    add_server_args(p)
    add_client_args(p, prefix="encoder-", what="the encoders")
    add_print_config(p)
    return p


async def serve(config: DecoderConfig, security: ServerSecurity | None = None,
                encoder_link: ClientSecurity | None = None) -> None:
    """Start the engine core, bind, wait until it is warm, report SERVING, run until SIGTERM/SIGINT,
    then shut down cleanly. `security` is the server's TLS and auth, `encoder_link` the encoders'."""
    from decoder_svc.core_client import CoreUsageError, EngineCoreClient
    from decoder_svc.engine.input_processor import InputProcessor
    from decoder_svc.engine_core import engine_config
    from decoder_svc.metrics import DecoderMetrics
    from decoder_svc.server import SERVICE_NAME, DecoderServicer

    accepted(config)  # an unreadable --embedding-transports entry is refused before the model loads
    metrics = DecoderMetrics()
    core = EngineCoreClient(config, encoder_link,
                            on_step=lambda outputs, seconds: metrics.step_seconds.observe(seconds))
    try:
        info = await asyncio.to_thread(core.start)  # loads the model and warms up: minutes on a GPU
    except CoreUsageError as exc:
        raise UsageError(str(exc)) from None
    inputs = await asyncio.to_thread(InputProcessor.for_model, engine_config(config), info.kv_capacity_tokens)
    # The front end's own link to the encoders: Qwen-VL hash-only images' grids, new files sent ahead.
    from decoder_svc.encoders.discovery import EncoderPool, GrpcHealthCheck
    from decoder_svc.encoders.front_link import FrontEndLink

    link = encoder_link or ClientSecurity()
    pool = EncoderPool(config.encoders.addresses, interval_s=config.encoders.resolve_interval_s,
                       health_check=GrpcHealthCheck(tls=link.tls))
    servicer = DecoderServicer(core, inputs, metrics, encoders=FrontEndLink(pool, link.tls, link.token),
                               send_ahead=config.encoders.send_ahead)
    service = GrpcService("decoder", config.service.host, config.port, config.service.metrics_port,
                          security=security)
    service.add(decoder_pb2_grpc.add_DecoderServiceServicer_to_server, servicer, SERVICE_NAME)
    try:
        port = await start_listening(service)
    except UsageError:
        await asyncio.to_thread(core.stop)
        raise

    async def refresh_metrics() -> None:
        last_line, last_logged = "", 0.0
        while True:
            if core.error is not None:  # the engine core died: stop taking traffic, say why, exit
                log.error("engine core failed (%s); health is now NOT_SERVING; exiting so that a "
                          "restart policy brings the decoder back", core.error)
                service.set_serving(False)
                await asyncio.sleep(_DEATH_GRACE_S)  # open streams receive their error first
                service.request_stop()
                raise EngineDied(core.error)
            stats = await servicer.stats()
            metrics.observe_stats(stats)
            line = stats.log_line()
            if line != last_line and time.monotonic() - last_logged >= _STATS_LOG_INTERVAL_S:
                log.info("stats: %s", line)
                last_line, last_logged = line, time.monotonic()
            await asyncio.sleep(1.0)

    refresher = asyncio.create_task(refresh_metrics())
    service.set_serving(True)
    accepts = transport_list_names(accepted(config))  # what its fetches ask for
    log.info("decoder ready on %s:%d (%s, %s, encoders %s, transports %s, %s loop)", config.service.host,
             port, config.engine.device, config.engine.dtype, ", ".join(config.encoders.addresses), accepts,
             event_loop.running_kind())

    stopping = ShutdownClock(config.drain_timeout_s)

    async def drain() -> None:
        stopping.start()
        await servicer.drain()
        log.info("drained in %.2f s", stopping.elapsed())

    async def shutdown() -> None:
        refresher.cancel()
        ended = core.open_stream_ids()
        if ended:  # the drain ran out of time: end the rest with a clear error
            servicer.end_drain()
            await asyncio.sleep(_DEATH_GRACE_S)
        # After the drain nothing is in flight: what is left of the margin bounds the core's stop.
        await asyncio.to_thread(core.stop, stopping.left(_CORE_STOP_MIN_S))
        if servicer.encoders is not None:
            if ended:  # their leases, which a killed core, or an answer lost on a stalled link, left behind
                freed = await asyncio.to_thread(servicer.encoders.release_requests, ended, core.lease_owner,
                                                min(_RELEASE_TIMEOUT_S, stopping.left(_RELEASE_MIN_S)))
                log.info("released %d encoder leases of %d requests the drain timeout ended", freed,
                         len(ended))
            servicer.encoders.close()
        log.info("engine core stopped; %.2f s since SIGTERM", stopping.elapsed())

    await service.wait(on_shutdown=shutdown, drain=drain, drain_timeout=config.drain_timeout_s,
                       grace=_GRPC_GRACE_S)
    if refresher.done() and not refresher.cancelled() and refresher.exception() is not None:
        raise refresher.exception()


class EngineDied(RuntimeError):
    """The engine core stopped on an error it could not absorb (a device error, a bug)."""


_DEATH_GRACE_S = 1.0
# The engine core's stop gets what the drain leaves of --drain-timeout + _EXIT_MARGIN_S (at least
# _CORE_STOP_MIN_S), then the gRPC server its grace (nothing is in flight after the drain).
_EXIT_MARGIN_S = 1.0
_CORE_STOP_MIN_S = 0.5
_GRPC_GRACE_S = 0.3
# The ended requests' leases, given back at the encoders after the core stopped: what is left of the
# margin, within these bounds (an encoder that does not answer at once has its TTL).
_RELEASE_TIMEOUT_S = 0.5
_RELEASE_MIN_S = 0.2


def exit_without_teardown(code: int) -> None:
    """Exit at once after a clean shutdown (the engine core and the server stopped, nothing in flight):
    the interpreter's own teardown (joining idle worker threads, collecting the heap) took 1.7-4.6 s on
    the loaded 2-core VM, past the drain timeout + margin that SIGTERM promises."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ShutdownClock:
    """Seconds since the drain began, and what is left of drain timeout + margin."""

    def __init__(self, drain_timeout_s: float, margin_s: float = _EXIT_MARGIN_S) -> None:
        self.budget_s = drain_timeout_s + margin_s
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def left(self, at_least: float) -> float:
        return max(at_least, self.budget_s - self.elapsed())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the decoder until a signal. Exit codes: 0 after a clean stop, 1 when the engine died (a
    restart policy should bring it back), 2 for a user error (one line on stderr, nothing loaded)."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(DecoderConfig, args)  # the config's own checks, before anything loads
    except ValueError as exc:  # one line, e.g. --device cuda on a CPU build of torch
        return report_usage_error(parser.prog, exc)
    if args.print_config:
        print(config_json(config))
        return 0
    configure_logging(config.service.log_level)
    try:
        # Before the model loads: a busy port fails now, not after the load.
        security = server_security_from_args(args)
        try:
            event_loop.loop_kind()  # $MMSERVE_EVENT_LOOP: a bad value is a usage error, now
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        # Unreadable files, or a token in plaintext to a remote encoder: now, before the model loads.
        encoder_link = client_security_from_args(args, prefix="encoder-", targets=args.encoder)
        check_port_free(config.service.host, config.port)
        if config.service.metrics_port is not None:
            check_port_free(security.metrics_host, config.service.metrics_port, "--metrics-port")
        # After the port checks: a download can take minutes.
        config.engine.model = resolve_checkpoint(config.engine.model, config.service.revision)
        c = config.engine
        c.dtype = resolve_dtype(c.dtype, c.device, c.model)  # auto: a Hub id's snapshot is here now
        event_loop.run(serve(config, security, encoder_link))
        exit_without_teardown(0)
    except KeyboardInterrupt:
        pass
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
    except EngineDied:
        return 1
    return 0
