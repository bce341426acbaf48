"""The arena's slice allocator: alignment, first fit, coalescing, refusal when full."""

from __future__ import annotations

import random

import pytest

from common.transport.arena import ALIGNMENT, SliceAllocator


def test_alloc_aligned_and_refuses_when_full():
    a = SliceAllocator(4 * ALIGNMENT)
    offsets = [a.alloc(100) for _ in range(4)]
    assert offsets == [0, ALIGNMENT, 2 * ALIGNMENT, 3 * ALIGNMENT]
    assert a.alloc(1) is None
    assert a.bytes_reserved == 4 * ALIGNMENT


def test_free_coalesces_neighbours():
    a = SliceAllocator(4 * ALIGNMENT)
    o = [a.alloc(ALIGNMENT) for _ in range(4)]
    a.free(o[1])
    a.free(o[3])
    assert a.alloc(2 * ALIGNMENT) is None  # two free runs, neither large enough
    a.free(o[2])  # merges with both neighbours
    assert a.largest_free() == 3 * ALIGNMENT
    assert a.alloc(3 * ALIGNMENT) == ALIGNMENT
    with pytest.raises(KeyError):
        a.free(12345)


def test_random_alloc_free_never_overlaps():
    rng = random.Random(0)
    a = SliceAllocator(64 * ALIGNMENT)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.randint(1, 5 * ALIGNMENT)
            off = a.alloc(n)
            if off is None:
                continue
            size = a.reserved_size(n)
            assert off % ALIGNMENT == 0 and off + size <= a.capacity
            for o, s in live.items():
                assert off + size <= o or o + s <= off
            live[off] = size
    for off in list(live):
        a.free(off)
    assert a.largest_free() == a.capacity
