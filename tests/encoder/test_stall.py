"""A tower that owes work and takes no step makes the encoder exit with every thread's stack in its log,
not hang (encoder_svc/stall.py; the worker's stalled_for_s)."""

from __future__ import annotations

import asyncio
import logging
import time

from encoder_svc.stall import STUCK_EXIT_CODE, watch_tower
from encoder_svc.worker import DEMAND
from tests.encoder.test_worker import _FakeVision, _running_worker, _submit


def test_stalled_for_s_counts_a_batch_in_progress_and_is_zero_when_idle():
    vision = _FakeVision()  # its first batch waits for the gate
    with _running_worker(vision) as (cache, worker):
        assert worker.stalled_for_s() == 0.0
        time.sleep(0.05)  # idle time is not owed work
        fut = _submit(cache, worker, "first", DEMAND)
        assert worker.stalled_for_s() < 0.05
        deadline = time.monotonic() + 5
        while worker.stalled_for_s() < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stalled_for_s() >= 0.05  # held in encode_prepared
        vision.gate.set()
        fut.result(timeout=5)
        deadline = time.monotonic() + 5
        while worker.stalled_for_s() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stalled_for_s() == 0.0


def test_stalled_for_s_counts_queued_work_the_tower_does_not_take():
    vision = _FakeVision()
    with _running_worker(vision) as (cache, worker):
        first = _submit(cache, worker, "first", DEMAND)
        while worker.queued():  # the tower took it and waits in encode_prepared
            pass
        worker._batch_since = None  # as if the tower thread had left its batch without taking the next
        _submit(cache, worker, "second", DEMAND)
        time.sleep(0.05)
        assert worker.stalled_for_s() >= 0.05, "queued work with no batch running is owed"
        vision.gate.set()
        first.result(timeout=5)


def test_a_stuck_batch_logs_the_stacks_says_not_serving_and_exits(caplog, capfd):
    events = []

    async def run() -> None:
        busy = iter([0.0, 0.01, 5.0])  # idle, a short batch, then one past the limit
        await watch_tower(lambda: next(busy), 0.04, on_stuck=lambda: events.append("not serving"),
                          exit_process=lambda code: events.append(code))

    with caplog.at_level(logging.ERROR, logger="mmserve.encoder"):
        asyncio.run(asyncio.wait_for(run(), 5))
    assert events == ["not serving", STUCK_EXIT_CODE]
    assert "the encoder is stuck" in caplog.text
    assert "Current thread" in capfd.readouterr().err  # faulthandler's dump of every thread


def test_a_busy_tower_within_the_limit_is_left_alone():
    events = []

    async def run() -> None:
        await watch_tower(lambda: 0.02, 0.04, exit_process=lambda code: events.append(code))

    try:
        asyncio.run(asyncio.wait_for(run(), 0.2))
    except TimeoutError:
        pass
    assert events == []
