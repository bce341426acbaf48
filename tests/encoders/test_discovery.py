"""Encoder discovery by DNS: target parsing, membership, health ejection, and ring stability."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest

from decoder_svc.encoders.discovery import (
    DnsTarget,
    EncoderPool,
    NoEncoderError,
    format_address,
    parse_dns_target,
    resolve_system,
)
from decoder_svc.encoders.routing import HashRing
from decoder_svc.main import main as decoder_main


class FakeDns:
    """A resolver whose answer the test sets; it can also fail like a timed-out lookup."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = list(ips)
        self.fail = False
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(self.ips)


class FakeHealth:
    """Health answers per address; addresses not in `down` are SERVING."""

    def __init__(self) -> None:
        self.down: set[str] = set()

    def __call__(self, address: str) -> bool:
        return address not in self.down


def _keys(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


def _pool(dns: FakeDns, health: FakeHealth | None = None, **kw) -> EncoderPool:
    return EncoderPool(["dns:///encoders.test:50051"], resolver=dns, health_check=health or FakeHealth(),
                       **kw)


@pytest.mark.parametrize("spec, target", [
    ("dns:///mmserve-encoder:50051", DnsTarget("mmserve-encoder", 50051)),
    ("dns:///mmserve-encoder.ns.svc.cluster.local:7", DnsTarget("mmserve-encoder.ns.svc.cluster.local", 7)),
    ("dns:///[::1]:50051", DnsTarget("::1", 50051)),
    ("127.0.0.1:50051", None),
    ("encoder:50051", None),
])
def test_targets_parse(spec, target):
    assert parse_dns_target(spec) == target


@pytest.mark.parametrize("spec", ["dns:///encoder", "dns:///encoder:", "dns:///:50051", "dns:///encoder:0",
                                  "dns:///encoder:http", "dns://8.8.8.8/encoder:50051"])
def test_malformed_targets_are_refused(spec):
    with pytest.raises(ValueError, match="dns"):
        parse_dns_target(spec)


def test_decoder_refuses_a_malformed_target_before_loading(capsys, tiny_model_dir):
    assert decoder_main(["--model", str(tiny_model_dir), "--encoder", "dns:///encoder"]) == 2  # usage error
    assert "dns:///NAME:PORT" in capsys.readouterr().err


def test_system_resolver_and_address_format():
    assert "127.0.0.1" in resolve_system("127.0.0.1", 50051)
    assert format_address("10.0.0.7", 50051) == "10.0.0.7:50051"
    assert format_address("fd00::7", 50051) == "[fd00::7]:50051"


def test_every_address_behind_the_name_joins_the_ring():
    dns = FakeDns(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    pool = _pool(dns)
    assert sorted(pool.members) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    assert dns.asked == [("encoders.test", 50051)]
    owners = {pool.route(k) for k in _keys(300)}
    assert owners == set(pool.members)
    pool.close()


def test_static_and_dns_targets_mix():
    dns = FakeDns(["10.0.0.1"])
    pool = EncoderPool(["static:1", "dns:///encoders.test:50051"], resolver=dns, health_check=FakeHealth())
    assert sorted(pool.members) == ["10.0.0.1:50051", "static:1"]
    dns.ips = []
    pool.refresh()
    assert pool.members == ["static:1"]  # a fixed address never leaves
    pool.close()


def test_growing_and_shrinking_moves_only_the_share_of_the_replica_that_came_or_went():
    dns = FakeDns(["10.0.0.1", "10.0.0.2"])
    pool = _pool(dns)
    keys = _keys(3000)
    before = {k: pool.route(k) for k in keys}

    dns.ips.append("10.0.0.3")
    change = pool.refresh()
    assert change.added == ("10.0.0.3:50051",) and change.removed == ()
    grown = {k: pool.route(k) for k in keys}
    moved = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == "10.0.0.3:50051" for k in moved)  # nothing moves between the old two
    assert 600 < len(moved) < 1400

    dns.ips.remove("10.0.0.1")
    change = pool.refresh()
    assert change.removed == ("10.0.0.1:50051",) and change.added == ()
    shrunk = {k: pool.route(k) for k in keys}
    assert all(grown[k] == "10.0.0.1:50051" for k in keys if shrunk[k] != grown[k])  # only its images move
    assert shrunk == {k: HashRing(["10.0.0.2:50051", "10.0.0.3:50051"]).route(k) for k in keys}
    pool.close()


def test_an_unhealthy_replica_leaves_after_eject_after_failures_and_comes_back_when_it_recovers():
    dns, health = FakeDns(["10.0.0.1", "10.0.0.2"]), FakeHealth()
    pool = _pool(dns, health, eject_after=2, admit_after=2)
    health.down.add("10.0.0.2:50051")
    assert pool.refresh().changed is False                     # one failed check: still in
    assert pool.refresh().removed == ("10.0.0.2:50051",)       # two: out
    assert all(pool.route(k) == "10.0.0.1:50051" for k in _keys(200))
    health.down.clear()
    assert pool.refresh().changed is False                     # one good check: not yet
    assert pool.refresh().added == ("10.0.0.2:50051",)         # two: back, with its old share
    assert {k: pool.route(k) for k in _keys(500)} == {
        k: HashRing(["10.0.0.1:50051", "10.0.0.2:50051"]).route(k) for k in _keys(500)}
    pool.close()


def test_an_address_joins_only_once_it_serves():
    dns, health = FakeDns(["10.0.0.1"]), FakeHealth()
    health.down.add("10.0.0.2:50051")
    pool = _pool(dns, health)
    dns.ips.append("10.0.0.2")
    assert pool.refresh().changed is False
    assert pool.members == ["10.0.0.1:50051"]
    pool.close()


def test_a_failed_lookup_keeps_the_ring():
    dns = FakeDns(["10.0.0.1", "10.0.0.2"])
    pool = _pool(dns)
    dns.fail = True
    assert pool.refresh().changed is False
    assert sorted(pool.members) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    pool.close()


def test_no_serving_encoder_is_a_clear_error_until_one_appears():
    dns = FakeDns([])
    pool = _pool(dns)
    with pytest.raises(NoEncoderError, match="dns:///encoders.test:50051"):
        pool.route(_keys(1)[0])
    dns.ips = ["10.0.0.9"]
    pool.refresh()
    assert pool.route(_keys(1)[0]) == "10.0.0.9:50051"
    pool.close()


def test_the_background_thread_follows_dns():
    dns = FakeDns(["10.0.0.1"])
    changed = threading.Event()
    pool = _pool(dns, interval_s=0.05)
    refresh = pool.refresh

    def watched():
        result = refresh()
        if result.changed:
            changed.set()
        return result

    pool.refresh = watched
    pool.start()
    dns.ips = ["10.0.0.1", "10.0.0.2"]
    assert changed.wait(30)
    assert sorted(pool.members) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    pool.close()
    assert not pool._thread.is_alive()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        EncoderPool([])
    with pytest.raises(ValueError):
        EncoderPool(["a:1"], interval_s=0)


def test_a_fixed_encoder_beside_another_leaves_the_ring_when_it_stops_answering():
    # Issue 67: with --encoder A --encoder B, A killed kept A's images (and their retries) on A until
    # the image's deadline; now A is ejected like a discovered replica, and comes back when it answers.
    health = FakeHealth()
    pool = EncoderPool(["127.0.0.1:1", "127.0.0.1:2"], health_check=health, eject_after=2)
    keys = _keys(200)
    assert {pool.route(k) for k in keys} == {"127.0.0.1:1", "127.0.0.1:2"}
    health.down.add("127.0.0.1:1")
    assert pool.refresh().changed is False
    assert pool.refresh().removed == ("127.0.0.1:1",)
    assert {pool.route(k) for k in keys} == {"127.0.0.1:2"}
    health.down.add("127.0.0.1:2")  # none answers: both stay routable rather than an empty ring
    pool.refresh()
    pool.refresh()
    assert sorted(pool.members) == ["127.0.0.1:1", "127.0.0.1:2"]
    health.down.clear()
    pool.refresh()
    assert {k: pool.route(k) for k in keys} == {k: HashRing(["127.0.0.1:1", "127.0.0.1:2"]).route(k)
                                                for k in keys}
    pool.close()


def test_a_lone_fixed_encoder_is_never_checked():
    health = FakeHealth()
    health.down.add("127.0.0.1:1")
    pool = EncoderPool(["127.0.0.1:1"], health_check=health)
    for _ in range(3):
        pool.refresh()
    assert pool.members == ["127.0.0.1:1"] and pool.checks_static is False
    pool.start()
    assert pool._thread is None
    pool.close()
