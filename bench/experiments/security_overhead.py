"""What TLS, mutual TLS and token authentication cost per RPC, on the real server skeleton.

    python -m bench.experiments.security_overhead [--calls 2000] [--payload-mib 9] [--out security.json]

One GrpcService per configuration (plaintext, TLS, mutual TLS, TLS + bearer tokens) serves a stub
EncoderService in a background thread; a blocking client then times, sequentially:
- Lookup: a small unary RPC (the auth interceptor, the token lookup and the salt rewrite are in it);
- Encode with an inline embedding of --payload-mib MiB (576 x 4096 fp32 is 9 MiB): the cross-host
  handoff, where TLS encrypts every byte.
No model and no GPU are involved: the numbers are the RPC layer's. Certificates come from
common.security.certs (needs `cryptography`), made into a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from collections.abc import Sequence

from bench.report import print_table, save_result
from bench.stats import summarize
from common.client import EncoderClient
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.security.auth import AuthPolicy
from common.security.certs import make_local_pki
from common.security.options import ServerSecurity
from common.security.tls import ClientTls, ServerTls
from common.security.tokens import TokenTable

TOKEN = "bench-token-0123456789abcdef0123"


class _StubEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, payload: bytes) -> None:
        self.response = encoder_pb2.EncodeResponse(embeddings=[common_pb2.EmbeddingRef(
            content_hash="00" * 32, shape=[len(payload) // 4 // 4096, 4096], dtype=common_pb2.DTYPE_FLOAT32,
            nbytes=len(payload), inline_data=payload)])

    async def Lookup(self, request, context):
        return encoder_pb2.LookupResponse(cached=[False] * len(request.content_hashes))

    async def Encode(self, request, context):
        return self.response


class _Server:
    def __init__(self, servicer, security: ServerSecurity) -> None:
        from common.server import GrpcService

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make():
            service = GrpcService("bench", "127.0.0.1", 0, security=security)
            service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer,
                        "mmserve.v1.EncoderService")
            return service, await service.start()

        self.service, self.port = asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _time(fn, calls: int) -> list[float]:
    for _ in range(min(20, calls)):  # warm: connection, TLS session, first allocations
        fn()
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.security_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="Lookup calls per configuration")
    p.add_argument("--payload-calls", type=int, default=50, help="inline Encode calls per configuration")
    p.add_argument("--payload-mib", type=float, default=9.0)
    p.add_argument("--device", default="cpu", help="recorded only: nothing runs on a device")
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        pki = make_local_pki(tmp, client_names=["client"])
        cert, key = pki.clients["client"]
        tokens = TokenTable.parse(f"tenant:bench {TOKEN}\n")
        server_tls = ServerTls.from_files(pki.server_cert, pki.server_key)
        mtls = ServerTls.from_files(pki.server_cert, pki.server_key, client_ca=pki.ca_cert)
        configs = [
            ("plaintext", ServerSecurity(), None, None),
            ("tls", ServerSecurity(tls=server_tls), ClientTls.from_files(pki.ca_cert), None),
            ("mtls", ServerSecurity(tls=mtls), ClientTls.from_files(pki.ca_cert, cert, key), None),
            ("tls+tokens", ServerSecurity(tls=server_tls, auth=AuthPolicy(tokens), reflection=False),
             ClientTls.from_files(pki.ca_cert), TOKEN),
        ]
        payload = bytes(int(args.payload_mib * (1 << 20)) // 16384 * 16384)
        servicer = _StubEncoder(payload)
        rows, results = [], {}
        for name, security, tls, token in configs:
            server = _Server(servicer, security)
            try:
                with EncoderClient(f"127.0.0.1:{server.port}", timeout=30, tls=tls, token=token) as client:
                    lookup = summarize(_time(lambda c=client: c.lookup(["00" * 32], cache_salt="s"),
                                             args.calls))
                    encode = summarize(_time(lambda c=client: c.encode([b"x"]), args.payload_calls))
            finally:
                server.close()
            gbps = len(payload) / (encode["p50_ms"] / 1e3) / 1e9
            results[name] = {"lookup": lookup, "inline_encode": encode, "inline_GBps_p50": gbps}
            rows.append([name, lookup["p50_ms"], lookup["p99_ms"], encode["p50_ms"], encode["p99_ms"], gbps])
    print_table(f"RPC cost by security setting (loopback, {len(payload) / (1 << 20):.1f} MiB inline payload)",
                ["config", "lookup p50 ms", "lookup p99 ms", "inline p50 ms", "inline p99 ms", "inline GB/s"],
                rows)
    save_result("security_overhead", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
