"""The hybrid stacks' bookkeeping, without a model: state slots (one per request, given back, none when
all are held) and the snapshot index (visible only once promoted, LRU eviction that never takes a pending
one, a failed step's pending ones dropped, the positions a prompt is snapshotted at)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decoder_svc.engine.state_slots import StateSlots
from decoder_svc.engine.state_snapshots import StateSnapshots


def _req(rid: str):
    return SimpleNamespace(request_id=rid)


def test_state_slots_one_per_request_and_given_back():
    slots = StateSlots(2)
    a, b, c = _req("a"), _req("b"), _req("c")
    assert (slots.take(a), slots.take(a), slots.take(b)) == (0, 0, 1)
    assert not slots.can_take(c) and slots.can_take(a) and slots.num_used == 2
    with pytest.raises(RuntimeError):
        slots.take(c)
    slots.free(a)
    slots.free(a)  # twice: nothing
    assert slots.take(c) == 0 and slots.slot(c) == 0 and not slots.holds(a)
    slots.free(b)
    slots.free(c)
    assert slots.num_used == 0


def test_snapshots_visible_once_promoted_and_lru():
    snaps = StateSnapshots(num_slots=2, first_slot=4, interval_blocks=2, bytes_per_snapshot=10)
    first = snaps.reserve(b"k1")
    assert first in (4, 5) and snaps.lookup(b"k1") is None  # pending: not visible
    assert snaps.reserve(b"k1") is None  # held already
    second = snaps.reserve(b"k2")
    assert snaps.reserve(b"k3") is None  # every slot pending: none evicted
    snaps.promote()
    assert (snaps.lookup(b"k1"), snaps.lookup(b"k2")) == (first, second) and snaps.bytes_held == 20
    assert snaps.use(b"k1") == first and snaps.counters.hits == 1  # k1 most recent: k2 goes first
    assert snaps.reserve(b"k3") == second and snaps.lookup(b"k2") is None
    snaps.drop_pending()  # its step failed
    assert snaps.lookup(b"k3") is None and snaps.num_held == 1
    assert snaps.reserve(b"k4") == second  # the dropped one's slot is free again
    snaps.promote()
    assert snaps.counters.taken == 3 and snaps.counters.evictions == 1


def test_snapshot_positions():
    snaps = StateSnapshots(num_slots=1, first_slot=0, interval_blocks=2, bytes_per_snapshot=1)
    # every 2 blocks of 16, the last boundary before the prompt's last token, each image's last boundary
    # most useful first: the prompt's last boundary, the images' (latest first), the interval points
    assert snaps.positions(100, [(5, 40)], 16) == [96, 32, 64]
    # 64 lies inside the second image: a prefix reaching it reaches that image's own snapshot, whose end
    # (80) goes down to 64, a multiple of fla's chunk (the first image's end, 32, has none past 0)
    assert snaps.positions(97, [(5, 40), (41, 90)], 16) == [96, 64, 32]
    assert snaps.positions(97, [(5, 40)], 16) == [96, 32, 64]
    assert snaps.positions(16, [(1, 15)], 16) == []  # nothing before the last token's block
    # a 1024-token image after 16 tokens, a 500-token question: its end (1040) on a chunk bound, 1024; the
    # prompt's last boundary stays at its block (1536); interval points (every 1024) inside the image left out
    wide = StateSnapshots(num_slots=1, first_slot=0, interval_blocks=64, bytes_per_snapshot=1)
    assert wide.positions(1538, [(16, 1040)], 16) == [1536, 1024]
    assert wide.positions(1570, [(16, 1040)], 16) == [1568, 1024]
    # interval points on the chunk bounds too (every 3 blocks of 16: 48 -> 48, 96 -> 64, 144 -> 128)
    thirds = StateSnapshots(num_slots=1, first_slot=0, interval_blocks=3, bytes_per_snapshot=1)
    assert thirds.positions(150, [], 16) == [144, 128, 64, 48]
    # a block of 48 tokens: positions on multiples of both (192)
    assert wide.positions(500, [(0, 450)], 48) == [480, 384]
