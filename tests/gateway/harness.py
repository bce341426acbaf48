"""A real gateway subprocess, a fake DecoderService that fails on demand, and a local image server."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.services import free_port
from common.pb import decoder_pb2, decoder_pb2_grpc
from gateway.health import wait_until_http_healthy
from tests.integration.harness import ROOT


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class GatewayProcess:
    """`mmserve gateway` as a subprocess on a free port; healthy once a decoder is SERVING."""

    decoders: list[str]
    log_path: Path
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_healthy: bool = True, timeout: float = 60.0) -> GatewayProcess:
        argv = [sys.executable, "-m", "common.cli", "gateway", "--port", str(self.port), *self.args]
        for decoder in self.decoders:
            argv += ["--decoder", decoder]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("MMSERVE_API_KEY", None)
        self.proc = subprocess.Popen(argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=env)
        if wait_healthy:
            ok = wait_until_http_healthy(f"{self.url}/health", timeout,
                                         is_alive=lambda: self.proc.poll() is None)
        else:  # no live decoder behind it: wait until it answers at all
            ok = self._wait_listening(timeout)
        if not ok:
            self.stop()
            raise RuntimeError(f"gateway did not start; log:\n{self.log_path.read_text(errors='replace')}")
        return self

    def _wait_listening(self, timeout: float) -> bool:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2)
                return True
            except urllib.error.HTTPError:
                return True
            except OSError:
                time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class FailingDecoder(decoder_pb2_grpc.DecoderServiceServicer):
    """Answers a prompt `fail:CODE` with that gRPC status before any output, and `fail-after-one:CODE`
    after one token; anything else gets two tokens. Each failure's details name a peer address, as
    gRPC's transport messages do: the gateway must not pass it on."""

    def Generate(self, request, context):
        prompt = request.prompt or "".join(
            p.text for m in request.chat.messages for p in m.content if p.WhichOneof("part") == "text")
        kind, _, code = prompt.partition(":")
        if kind == "fail":
            context.abort(grpc.StatusCode[code], f"fake decoder fails with {code} at {FAKE_PEER}")
        yield decoder_pb2.GenerateResponse(token_ids=[7], text="a")
        if kind == "fail-after-one":
            context.abort(grpc.StatusCode[code], f"fake decoder fails with {code} mid-stream")
        yield decoder_pb2.GenerateResponse(
            token_ids=[8], text="b", finish_reason=decoder_pb2.FINISH_REASON_LENGTH,
            usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=2))


FAKE_PEER = "ipv4:10.9.8.7:50052"


def start_failing_decoder() -> tuple[grpc.Server, str]:
    """A FailingDecoder on a free loopback port, reporting SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decoder_pb2_grpc.add_DecoderServiceServicer_to_server(FailingDecoder(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class ImageServer:
    """A local HTTP server: GET /NAME answers files[NAME] (404 otherwise); /redirect/NAME redirects to
    /NAME, redirects[NAME] to that location; a name in `slow` answers after 5 s."""

    def __init__(self, files: dict[str, bytes], redirects: dict[str, str] | None = None,
                 slow: tuple[str, ...] = ()) -> None:
        files_, redirects_ = files, redirects or {}
        self.hits: list[str] = []  # the paths asked for, in order
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hits.append(self.path.lstrip("/"))
                name = self.path.lstrip("/").split("?", 1)[0]  # a query only makes URLs distinct
                location = redirects_.get(name) or (
                    "/" + name.removeprefix("redirect/") if name.startswith("redirect/") else None)
                if location:
                    self.send_response(302)
                    self.send_header("Location", location)
                    self.end_headers()
                    return
                if name in slow:
                    time.sleep(5)
                if name not in files_:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(files_[name])))
                self.end_headers()
                try:
                    self.wfile.write(files_[name])
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> ImageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
