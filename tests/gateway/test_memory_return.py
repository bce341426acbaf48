"""The gateway gives freed memory back after a flood of requests of a few MB each (RELIABILITY.md, "Faults
under load": +50% RSS after 7 MB data URLs, when only a request of 16 MiB or more led to a trim)."""

from __future__ import annotations

import asyncio

from common.memory_return import MemoryReturn
from gateway.byte_budget import ByteBudget, GatewayBytes

MB7 = 7_000_000


def _flood(requests: int, size: int) -> MemoryReturn:
    """`requests` budgets of `size` bytes held at once, then released one by one; what ran after."""
    memory = MemoryReturn(delay_s=0.0, trim=lambda: True)

    async def run() -> None:
        gateway = GatewayBytes(limit=1 << 30, memory=memory)
        budgets = [ByteBudget(64 << 20, gateway=gateway) for _ in range(requests)]
        for b in budgets:
            b.take(size, None)
        for b in budgets:
            b.release()
            await asyncio.sleep(0)  # a scheduled trim's turn on the loop
        await asyncio.sleep(0.01)
        assert gateway.held == 0

    asyncio.run(run())
    return memory


def test_a_flood_of_7_mb_requests_is_followed_by_a_trim_and_a_collection():
    memory = _flood(30, MB7)
    assert memory.trims >= 1  # none before: each request was under 16 MiB
    assert memory.collections == 1  # once the burst was over: the cycles a failed request leaves


def test_one_such_request_on_an_idle_gateway_is_trimmed_after():
    memory = _flood(1, MB7)
    assert (memory.trims, memory.collections) == (1, 1)


def test_small_requests_do_not_trim_each_time():
    memory = _flood(1, 100_000)
    assert (memory.trims, memory.collections, memory.since_trim) == (0, 0, 100_000)


def test_bytes_add_up_and_the_end_of_a_burst_collects():
    memory = MemoryReturn(every=16, idle_min=4, delay_s=0.0, trim=lambda: True)
    assert [memory.freed(7, idle=False) for _ in range(3)] == [False, False, True]  # 21 >= 16
    assert memory.since_trim == 0
    assert memory.freed(3, idle=True) is False  # under idle_min
    assert memory.freed(1, idle=True) is True   # 4: the burst is over with enough let go
    assert memory.trims == 0  # no running loop: nothing scheduled, nothing given back


def test_a_pending_trim_is_not_doubled_and_collects_when_asked():
    ran: list[int] = []
    memory = MemoryReturn(delay_s=0.0, trim=lambda: ran.append(1) or True)

    async def run() -> None:
        memory.soon(collect=False)
        memory.soon(collect=True)  # joins the pending one
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert (len(ran), memory.trims, memory.collections) == (1, 1, 1)
