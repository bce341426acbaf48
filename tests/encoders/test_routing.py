"""Consistent hashing of content hashes onto encoders."""

from __future__ import annotations

import hashlib

import pytest

from decoder_svc.encoders.routing import HashRing


def _keys(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


def test_every_encoder_gets_a_fair_share_and_routing_is_stable():
    ring = HashRing(["a:1", "b:1", "c:1"])
    keys = _keys(3000)
    owners = [ring.route(k) for k in keys]
    for address in ("a:1", "b:1", "c:1"):
        assert 700 < owners.count(address) < 1300
    assert owners == [HashRing(["c:1", "a:1", "b:1"]).route(k) for k in keys]  # order-independent


def test_adding_an_encoder_moves_only_its_share():
    keys = _keys(3000)
    before = HashRing(["a:1", "b:1", "c:1"])
    after = HashRing(["a:1", "b:1", "c:1", "d:1"])
    moved = [k for k in keys if before.route(k) != after.route(k)]
    assert all(after.route(k) == "d:1" for k in moved)  # nothing moves between the old encoders
    assert 400 < len(moved) < 1100


def test_no_encoder_is_an_error():
    with pytest.raises(ValueError):
        HashRing([])
