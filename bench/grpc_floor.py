"""The floor under a request's inbound gRPC crossing, measured on the host at hand.

A bare server in its own process (grpc.aio on the services' event loop, the decoder's message limits and
heap settings, no servicer, no engine) stamps the moment a Generate request has arrived and been parsed,
and streams the stamp back; the client sends the very GenerateRequest bytes a benchmark sends the
decoder. What bench.ttft's `crossing` stage (client call to the front end's `received` stamp) spends
above this is the services' own; what is below it, gRPC's and the host's.

    python -m bench.grpc_floor --image-size 1024 --rounds 20     (alone, with a noise PNG)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc

from common.client import CHANNEL_OPTIONS, generate_request
from common.event_loop import run as run_loop
from common.freed_memory import reuse_freed_blocks
from common.pb import decoder_pb2
from common.server import DEFAULT_MAX_MESSAGE_BYTES

METHOD = "/mmserve.v1.DecoderService/Generate"
_STAMP = struct.Struct("<d")


async def _serve() -> None:
    reuse_freed_blocks()  # as the services do (common/server.py)
    async def generate(request: decoder_pb2.GenerateRequest, context):
        yield _STAMP.pack(time.monotonic())

    server = grpc.aio.server(options=[("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES)])
    handler = grpc.unary_stream_rpc_method_handler(
        generate, request_deserializer=decoder_pb2.GenerateRequest.FromString)
    service, method = METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.stop(None)


def crossing_floor(requests: Sequence[decoder_pb2.GenerateRequest], repeats: int = 3) -> dict:
    """ms from the call to the bare server's parsed-request stamp, per request, `repeats` times each
    (the first pass unmeasured): p50 / mean / min / max and the request's size."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            call = channel.unary_stream(
                METHOD, request_serializer=decoder_pb2.GenerateRequest.SerializeToString)
            seconds = []
            for n in range(repeats + 1):
                for request in requests:
                    started = time.monotonic()
                    (stamp,) = _STAMP.unpack(next(iter(call(request, timeout=60))))
                    if n:
                        seconds.append(stamp - started)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    ms = sorted(1000 * s for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 2), "mean_ms": round(statistics.mean(ms), 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2), "n": len(ms),
            "request_bytes": max(r.ByteSize() for r in requests)}


def main(argv: list[str] | None = None) -> int:
    """`--serve`: the bare server (prints its port, runs until stdin closes); else measure alone."""
    p = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=10, help="requests, each a new noise PNG")
    args = p.parse_args(argv)
    if args.serve:
        run_loop(_serve())
        return 0
    from bench.workload import random_png

    requests = [generate_request("<image> Describe it.", [random_png(i, args.image_size)], max_tokens=1)
                for i in range(args.rounds)]
    print(crossing_floor(requests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
