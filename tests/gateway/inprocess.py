"""The gateway app in this process (Starlette's TestClient) over a fake decoder that records every
Generate call and can hold streams open: quick tests of admission and budgets, without services."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.testclient import TestClient

from common.pb import decoder_pb2, decoder_pb2_grpc
from gateway.app import build_app
from gateway.config import GatewayConfig, ImageFetchPolicy, RequestLimits


class RecordingDecoder(decoder_pb2_grpc.DecoderServiceServicer):
    """Answers every call (each of its `n` choices) with one token, then, once `release` is set, a last
    one; records the requests.
    A prompt `fail:CODE` (or `fail:CODE:DETAILS`) is answered with that status before any output. With
    logprobs asked, each token has logprob -0.5 and the top ones are ids 100, 101, ... (never the
    sampled token, as sampling can give)."""

    def __init__(self) -> None:
        self.requests: list[decoder_pb2.GenerateRequest] = []
        self.release = threading.Event()
        self.release.set()  # streams end at once unless a test clears it
        self.finished = 0

    def Generate(self, request, context):
        self.requests.append(request)
        text = request.prompt or "".join(
            p.text for m in request.chat.messages for p in m.content if p.WhichOneof("part") == "text")
        kind, _, rest = text.partition(":")
        code, _, details = rest.partition(":")
        if kind == "fail":
            context.abort(grpc.StatusCode[code], details or f"fake decoder fails with {code}")
        top = request.sampling.logprobs
        logprobs = [decoder_pb2.TokenLogprobs(
            logprob=-0.5, top_ids=[100 + i for i in range(top)],
            top_logprobs=[-0.25 * (i + 1) for i in range(top)])] if top else []
        choices = range(max(request.n, 1))  # each of the request's samples, told apart by its index
        # As the decoder does: the first message carries the prompt's counts, the last the totals.
        for index in choices:
            yield decoder_pb2.GenerateResponse(token_ids=[7], text="a", logprobs=logprobs, index=index,
                                               usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=1))
        while not self.release.wait(0.05):
            if not context.is_active():
                return
        self.finished += 1
        for index in choices:
            yield decoder_pb2.GenerateResponse(
                token_ids=[8], text="b", finish_reason=decoder_pb2.FINISH_REASON_LENGTH, logprobs=logprobs,
                usage=decoder_pb2.Usage(prompt_tokens=3, completion_tokens=2), index=index)


@contextmanager
def fake_decoder() -> Iterator[tuple[RecordingDecoder, str]]:
    """A RecordingDecoder on a free loopback port, reporting SERVING: (servicer, address)."""
    servicer = RecordingDecoder()
    server = grpc.server(futures.ThreadPoolExecutor(16))
    decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        server.stop(0)


@contextmanager
def gateway_client(address: str, **config) -> Iterator[TestClient]:
    """A TestClient over the gateway app for GatewayConfig(decoders=[address], **config); `images` and
    `limits` may be dicts of their sections' fields."""
    config.setdefault("served_model_names", ["m"])
    for name, section in (("images", ImageFetchPolicy), ("limits", RequestLimits)):
        if isinstance(config.get(name), dict):
            config[name] = section(**config[name])
    app = build_app(GatewayConfig(decoders=[address], **config))
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client
