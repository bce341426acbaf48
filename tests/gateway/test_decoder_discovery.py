"""The gateway finds decoders that appear behind a file: or dns:/// target and retires those that go
(issue 67: a drained decoder's replacement is found without restarting the gateway), and sends a request
that a decoder refused before its first token to another one."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from common.pb import decoder_pb2
from gateway.balancer import DecoderEndpoint, DecoderPool
from gateway.config import GatewayConfig
from gateway.discovery import DecoderTargets


def test_a_file_target_lists_its_lines_and_keeps_them_when_unreadable(tmp_path):
    listing = tmp_path / "decoders"
    listing.write_text("127.0.0.1:1\n# a comment\n\n127.0.0.1:2  # the second\n")
    targets = DecoderTargets([f"file:{listing}", "127.0.0.1:3", "127.0.0.1:1"])
    assert targets.dynamic
    assert targets.addresses() == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    listing.unlink()
    assert targets.addresses() == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # a failed read keeps them


def test_a_dns_target_lists_every_address_and_survives_a_failed_lookup():
    answers = [["10.0.0.1", "10.0.0.2"]]

    def resolver(host, port):
        if not answers:
            raise socket.gaierror(socket.EAI_AGAIN, "try again")
        return answers.pop()

    targets = DecoderTargets(["dns:///decoders.test:50052"], resolver=resolver)
    assert targets.addresses() == ["10.0.0.1:50052", "10.0.0.2:50052"]
    assert targets.addresses() == ["10.0.0.1:50052", "10.0.0.2:50052"]


def test_fixed_targets_are_not_dynamic():
    assert not DecoderTargets(["127.0.0.1:1", "127.0.0.1:2"]).dynamic


@pytest.mark.parametrize("spec", ["file:", "dns:///decoder", "dns://8.8.8.8/decoder:1"])
def test_malformed_targets_are_refused_by_the_config(spec):
    with pytest.raises(ValueError):
        GatewayConfig(decoders=[spec])


def test_the_pool_adds_what_appears_and_retires_what_goes_once_its_calls_end(tmp_path):
    listing = tmp_path / "decoders"
    listing.write_text("127.0.0.1:1\n127.0.0.1:2\n")

    async def scenario():
        pool = DecoderPool.of([f"file:{listing}"], health_interval_s=3600)
        assert [e.address for e in pool.endpoints] == ["127.0.0.1:1", "127.0.0.1:2"]
        pool.start()
        try:
            old = pool.endpoints[0]
            old.outstanding = 1  # a call still open on the decoder that goes away
            listing.write_text("127.0.0.1:2\n127.0.0.1:3\n")
            assert pool.refresh() == (["127.0.0.1:3"], ["127.0.0.1:1"])
            assert [e.address for e in pool.endpoints] == ["127.0.0.1:2", "127.0.0.1:3"]
            assert pool.endpoints[1].stub is not None  # connected: it can take calls at once
            assert pool.pick(exclude=[pool.endpoints[0]]).address == "127.0.0.1:3"
            assert old in pool._retired  # its open call keeps its channel
            old.outstanding = 0
            assert pool.refresh() == ([], [])
            assert old not in pool._retired
        finally:
            await pool.close()

    asyncio.run(scenario())


class _Call:
    """A fake Generate call: its messages, or the error its first read raises."""

    def __init__(self, messages=(), error: grpc.StatusCode | None = None) -> None:
        self.messages, self.error, self.cancelled = list(messages), error, False

    async def read(self):
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


class _Stub:
    def __init__(self, error: grpc.StatusCode | None = None) -> None:
        self.error, self.calls = error, 0

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.calls += 1
        return _Call([decoder_pb2.GenerateResponse(token_ids=[1])], self.error)


@pytest.mark.parametrize("first_error, retried", [(grpc.StatusCode.UNAVAILABLE, True),
                                                  (grpc.StatusCode.INVALID_ARGUMENT, False)])
def test_a_request_refused_before_its_first_token_goes_to_another_decoder(first_error, retried):
    # A draining or dead decoder answers UNAVAILABLE before anything streamed: the request is sent to
    # the next decoder (no byte reached the client). The client's own mistake is not sent twice.
    async def scenario():
        down, up = DecoderEndpoint("down"), DecoderEndpoint("up")
        down.stub, up.stub = _Stub(first_error), _Stub()
        down.outstanding = -1  # picked first
        pool = DecoderPool([down, up])
        request = decoder_pb2.GenerateRequest(prompt="hi")
        if not retried:
            with pytest.raises(grpc.aio.AioRpcError):
                await pool.generate(request, timeout=5)
            return down, up, None
        return down, up, await pool.generate(request, timeout=5)

    down, up, generation = asyncio.run(scenario())
    assert down.stub.calls == 1
    if retried:
        assert generation.endpoint is up and up.stub.calls == 1 and down.status == "UNREACHABLE"
        assert down.outstanding == -1  # its failed call is no longer counted there
    else:
        assert up.stub.calls == 0
