"""`mmserve decoder`: start the decoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
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
from common.pb import decoder_pb2_grpc
from common.security.options import (
    add_client_args,
    add_server_args,
    client_security_from_args,
    server_security_from_args,
)
from common.server import GrpcService, configure_logging

log = logging.getLogger("mmserve.decoder")
_STATS_LOG_INTERVAL_S = 10.0  # the stats line is logged at most this often, and only when it changed


def build_arg_parser() -> argparse.ArgumentParser:
    """The decoder's command-line options."""
    p = argparse.ArgumentParser(prog="mmserve decoder", description="LLaVA decoder service")
    p.add_argument("--model", type=model_dir, required=True,
                   help="LLaVA checkpoint: a directory, or a Hugging Face Hub id (found in the HF cache, "
                   "else downloaded unless HF_HUB_OFFLINE=1)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit for a Hub id --model")
    p.add_argument("--encoder", action="append", default=[], metavar="HOST:PORT",
                   help="encoder address (repeat for several: images are routed by consistent hash), or "
                   "dns:///NAME:PORT for every address behind NAME (e.g. a headless Service), re-resolved "
                   "every --encoder-resolve-interval seconds")
    p.add_argument("--encoder-resolve-interval", type=positive_float, default=5.0,
                   help="seconds between DNS lookups and health checks of dns:/// encoders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=50052, help="0 picks a free port")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", type=dtype_name, default="float32", help="float32, float16 or bfloat16")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="running requests at most")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=positive_int, default=None)
    kv.add_argument("--kv-cache-bytes", type=positive_int, default=None)
    p.add_argument("--encoder-max-ahead", type=non_negative_int, default=4,
                   help="queued requests whose images are requested ahead of their prefill (0: off)")
    p.add_argument("--max-tokens-default", type=positive_int, default=256,
                   help="max_tokens when a request gives 0")
    p.add_argument("--max-waiting", type=positive_int, default=4096,
                   help="queue size before RESOURCE_EXHAUSTED")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto",
                   help="kernels: auto takes Triton on CUDA and the torch reference elsewhere")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--encoder-timeout", type=positive_float, default=20.0,
                   help="seconds from an image's first ask until an unreachable encoder fails the request "
                   "(UNAVAILABLE)")
    p.add_argument("--drain-timeout", type=positive_float, default=30.0,
                   help="on SIGTERM, seconds in-flight streams may take to finish (new ones get UNAVAILABLE)")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="Prometheus /metrics port (off if unset)")
    add_server_args(p)
    add_client_args(p, prefix="encoder-", what="the encoders")
    p.add_argument("--log-level", default="INFO")
    return p


async def serve(args: argparse.Namespace) -> None:
    """Start the engine core, bind, wait until it is warm, report SERVING, run until SIGTERM/SIGINT,
    then shut down cleanly."""
    from decoder_svc.core_client import CoreUsageError, EngineCoreClient
    from decoder_svc.engine.input_processor import InputProcessor
    from decoder_svc.engine_core import engine_config
    from decoder_svc.metrics import DecoderMetrics
    from decoder_svc.server import SERVICE_NAME, DecoderServicer

    metrics = DecoderMetrics()
    core = EngineCoreClient(args, on_step=lambda outputs, seconds: metrics.step_seconds.observe(seconds))
    try:
        info = await asyncio.to_thread(core.start)  # loads the model and warms up: minutes on a GPU
    except CoreUsageError as exc:
        raise UsageError(str(exc)) from None
    inputs = await asyncio.to_thread(InputProcessor.for_model, engine_config(args), info.kv_capacity_tokens)
    servicer = DecoderServicer(core, inputs, metrics)
    service = GrpcService("decoder", args.host, args.port, args.metrics_port,
                          security=getattr(args, "security", None))
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
            stats = await core.stats()
            metrics.observe_stats(stats)
            line = stats.log_line()
            if line != last_line and time.monotonic() - last_logged >= _STATS_LOG_INTERVAL_S:
                log.info("stats: %s", line)
                last_line, last_logged = line, time.monotonic()
            await asyncio.sleep(1.0)

    refresher = asyncio.create_task(refresh_metrics())
    service.set_serving(True)
    log.info("decoder ready on %s:%d (%s, %s, encoders %s)", args.host, port, args.device, args.dtype,
             ", ".join(args.encoder))

    async def shutdown() -> None:
        refresher.cancel()
        if core.num_open_streams:  # the drain ran out of time: end the rest with a clear error
            servicer.end_drain()
            await asyncio.sleep(_DEATH_GRACE_S)
        await asyncio.to_thread(core.stop)

    await service.wait(on_shutdown=shutdown, drain=servicer.drain, drain_timeout=args.drain_timeout)
    if refresher.done() and not refresher.cancelled() and refresher.exception() is not None:
        raise refresher.exception()


class EngineDied(RuntimeError):
    """The engine core stopped on an error it could not absorb (a device error, a bug)."""


_DEATH_GRACE_S = 1.0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the decoder until a signal. Exit codes: 0 after a clean stop, 1 when the engine died (a
    restart policy should bring it back), 2 for a user error (one line on stderr, nothing loaded)."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if not args.encoder:
        parser.error("give at least one --encoder HOST:PORT (or dns:///NAME:PORT)")
    from decoder_svc.encoders.discovery import parse_dns_target

    for spec in args.encoder:
        try:
            parse_dns_target(spec)
        except ValueError as exc:
            parser.error(f"--encoder {exc}")
    configure_logging(args.log_level)
    try:
        # Before the model loads: a busy port fails now, not after the load.
        args.security = server_security_from_args(args)
        client_security_from_args(args, prefix="encoder-")  # unreadable files: a usage error, now
        check_port_free(args.host, args.port)
        if args.metrics_port is not None:
            check_port_free(args.metrics_host, args.metrics_port, "--metrics-port")
        resolve_model_arg(args)  # after the port checks: a download can take minutes
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
    except EngineDied:
        return 1
    return 0
