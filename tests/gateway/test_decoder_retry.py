"""A request whose decoder went away before anything of it reached the client is started again on another
decoder (issue 67, gateway/decoder_retry.py): in-process gateway over two fake decoders that follow one
shared script, call by call. Counts and states only."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.testclient import TestClient

from common.pb import decoder_pb2, decoder_pb2_grpc
from gateway.app import build_app
from gateway.balancer import DecoderEndpoint, DecoderPool
from gateway.config import GatewayConfig
from gateway.decoder_retry import DecoderAttempts, decoder_went_away

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Script:
    """What each Generate call does, in the order calls arrive at either decoder: `ok` (two tokens),
    `refuse:CODE` (that status before any output), `die:CODE` (one token, then that status), `stop`
    (one token, then the decoder's server stops, as a killed decoder's connection ends). Calls past the
    script are `ok`."""

    steps: list[str] = field(default_factory=list)
    calls: list[tuple[str, decoder_pb2.GenerateRequest]] = field(default_factory=list)  # (decoder, request)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, decoder: str, request: decoder_pb2.GenerateRequest) -> str:
        with self.lock:
            self.calls.append((decoder, request))
            return self.steps.pop(0) if self.steps else "ok"

    def on(self, decoder: str) -> int:
        return sum(name == decoder for name, _ in self.calls)


class ScriptedDecoder(decoder_pb2_grpc.DecoderServiceServicer):
    def __init__(self, name: str, script: Script) -> None:
        self.name, self.script = name, script
        self.server: grpc.Server | None = None

    def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
        step = self.script.next(self.name, request)
        kind, _, code = step.partition(":")
        if kind == "refuse":
            context.abort(grpc.StatusCode[code], f"{self.name} refuses with {code}")
        for index in range(max(request.n, 1)):
            yield decoder_pb2.GenerateResponse(token_ids=[7], text="a", index=index,
                                               usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=1))
        if kind == "die":
            context.abort(grpc.StatusCode[code], "Socket closed")
        if kind == "stop":
            threading.Thread(target=self.server.stop, args=(0,), daemon=True).start()
            while context.is_active():
                time.sleep(0.01)
            return
        for index in range(max(request.n, 1)):
            yield decoder_pb2.GenerateResponse(
                token_ids=[8], text=self.name[-1], finish_reason=decoder_pb2.FINISH_REASON_LENGTH,
                index=index, usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=2))


@dataclass
class FakeDecoder:
    servicer: ScriptedDecoder
    health: health.HealthServicer
    address: str

    def set_health(self, status) -> None:
        self.health.set("", status)


@contextmanager
def decoders(script: Script, count: int = 2) -> Iterator[list[FakeDecoder]]:
    """`count` ScriptedDecoders (named decoder0, decoder1, ...) on free loopback ports, SERVING."""
    made, servers = [], []
    for i in range(count):
        servicer = ScriptedDecoder(f"decoder{i}", script)
        server = grpc.server(futures.ThreadPoolExecutor(8))
        servicer.server = server
        decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        made.append(FakeDecoder(servicer, health_servicer, f"127.0.0.1:{port}"))
    try:
        yield made
    finally:
        for server in servers:
            server.stop(0)


@contextmanager
def gateway(fakes: list[FakeDecoder], **config) -> Iterator[TestClient]:
    """The gateway app over the fakes; health is asked only by GET /health (and once at start)."""
    app = build_app(GatewayConfig(decoders=[f.address for f in fakes], served_model_names=["m"],
                                  decoder_check_interval_s=3600, **config))
    with TestClient(app, raise_server_exceptions=True) as client:
        client.get("/health")  # the decoders' states known before any request
        yield client


def restarts(client: TestClient) -> float:
    text = client.get("/metrics").text
    found = re.search(r'^mmserve_gateway_decoder_retries_total\{kind="restart"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def chat(client: TestClient, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return client.post("/v1/chat/completions", json=body)


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("failure", ["die:UNAVAILABLE", "die:CANCELLED", "stop", "refuse:CANCELLED"])
def test_a_whole_response_whose_decoder_went_away_completes_on_another(failure):
    # The decoder died after its first token (UNAVAILABLE, cancelled by the peer, its server stopped) or
    # before (CANCELLED, which the pool's own fail-over does not take): nothing was sent to the client, so
    # the request starts again on the other decoder with the same seed and n.
    script = Script([failure])
    with decoders(script) as fakes, gateway(fakes) as client:
        reply = chat(client, n=2, seed=5)
        assert reply.status_code == 200, reply.text
        assert restarts(client) == 1
    assert [script.on("decoder0"), script.on("decoder1")] == [1, 1]
    first, second = script.calls[0][1], script.calls[1][1]
    assert (second.n, second.sampling.seed, second.request_id) == (2, 5, first.request_id)
    survivor = script.calls[1][0][-1]
    assert [c["message"]["content"] for c in reply.json()["choices"]] == ["a" + survivor] * 2


def test_a_completion_list_restarts_every_prompt_on_the_other_decoder():
    # Two prompts are two calls on one decoder: the second dies after its first token, so both start again.
    script = Script(["ok", "die:UNAVAILABLE"])
    with decoders(script) as fakes, gateway(fakes) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": ["one", "two"], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert restarts(client) == 1
    assert len(script.calls) == 4 and script.calls[2][0] == script.calls[3][0] != script.calls[0][0]
    assert [c["text"] for c in reply.json()["choices"]] == ["a" + script.calls[2][0][-1]] * 2


def test_a_stream_that_sent_a_token_is_not_started_again():
    script = Script(["die:UNAVAILABLE"])
    with decoders(script) as fakes, gateway(fakes) as client:
        reply = chat(client, stream=True)
        assert reply.status_code == 200
        events = sse_events(reply.text)
        assert any(c.get("delta", {}).get("content") == "a" for e in events for c in e.get("choices", []))
        assert events[-1]["error"]["code"] == "unavailable"  # the client gets the error, as before
        assert restarts(client) == 0 and len(script.calls) == 1
        # A stream whose decoder went away before its first message had nothing sent: it starts again.
        script.steps.append("refuse:CANCELLED")
        reply = chat(client, stream=True)
        assert "error" not in reply.text and restarts(client) == 1
    assert len(script.calls) == 3 and script.calls[1][0] != script.calls[2][0]


@pytest.mark.parametrize("code, status", [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429),
                                          ("DEADLINE_EXCEEDED", 504)])
def test_a_failure_of_the_request_itself_is_not_sent_elsewhere(code, status):
    script = Script([f"die:{code}"])
    with decoders(script) as fakes, gateway(fakes) as client:
        reply = chat(client)
        assert reply.status_code == status
        assert restarts(client) == 0 and len(script.calls) == 1
        script.steps.append("die:UNAVAILABLE")  # the same fleet does restart a decoder's going away
        assert chat(client).status_code == 200 and restarts(client) == 1


def test_no_restart_without_another_healthy_decoder():
    script = Script(["die:UNAVAILABLE"])
    with decoders(script) as fakes, gateway(fakes) as client:
        fakes[1].set_health(NOT_SERVING)
        client.get("/health")
        reply = chat(client)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert script.on("decoder1") == 0 and restarts(client) == 0
        fakes[1].set_health(SERVING)
        client.get("/health")
        script.steps.append("die:UNAVAILABLE")
        reply = chat(client)
        assert reply.status_code == 200 and restarts(client) == 1 and script.on("decoder1") == 1


def test_no_restart_with_one_decoder_or_with_retries_off():
    script = Script(["die:UNAVAILABLE"])
    with decoders(script, count=1) as fakes, gateway(fakes) as client:
        reply = chat(client)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert restarts(client) == 0 and len(script.calls) == 1
    for retries, status, calls in ((0, 503, 1), (1, 200, 2)):  # --decoder-retries 0 turns it off
        script = Script(["die:UNAVAILABLE"])
        with decoders(script) as fakes, gateway(fakes, decoder_retries=retries) as client:
            assert chat(client).status_code == status and len(script.calls) == calls


def test_what_counts_as_a_decoder_going_away():
    def error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    assert decoder_went_away(error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert decoder_went_away(error(grpc.StatusCode.CANCELLED, "Cancelled"))
    assert decoder_went_away(error(grpc.StatusCode.INTERNAL, "Stream removed (Connection reset by peer)"))
    assert not decoder_went_away(error(grpc.StatusCode.INTERNAL, "the decoder failed"))
    assert not decoder_went_away(error(grpc.StatusCode.UNAVAILABLE, "vision encoder: unreachable"))
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED):
        assert not decoder_went_away(error(code, "Socket closed"))


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    async def read(self):
        return decoder_pb2.GenerateResponse(token_ids=[1])

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


class _Stub:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.timeouts.append(timeout)
        return _Call()


@pytest.mark.parametrize("spent_s, retried", [(4.0, True), (20.0, False)])
def test_a_restart_gets_what_is_left_of_the_deadline(spent_s, retried):
    async def scenario():
        gone, other = DecoderEndpoint("gone", status="SERVING"), DecoderEndpoint("other", status="SERVING")
        gone.stub, other.stub = _Stub(), _Stub()
        attempts = DecoderAttempts(DecoderPool([gone, other]), [decoder_pb2.GenerateRequest(prompt="x")],
                                   "r", timeout_s=10.0, started_at=time.monotonic() - spent_s, tried=[gone])
        error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                     details="Socket closed")
        return await attempts.again(error), gone, other

    group, gone, other = asyncio.run(scenario())
    assert gone.status == "UNREACHABLE"  # until the next health round
    if retried:
        assert group is not None and group.members[0].endpoint is other
        assert other.stub.timeouts[0] <= 10.0 - 4.0
    else:
        assert group is None and other.stub.timeouts == []
