"""The gateway finds decoders that appear behind a file: or dns:/// target and retires those that go
(issue 67: a drained decoder's replacement is found without restarting the gateway)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.balancer import DecoderPool
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
