"""The vision worker: demand before prefetch, batching by priority, boosting a joined prefetch."""

from __future__ import annotations

import threading

import torch

from common.transport.arena import TensorArena
from encoder_svc.cache import EmbeddingCache
from encoder_svc.worker import DEMAND, PREFETCH, VisionWorker


class _FakeVision:
    """Records each batch; the first batch blocks until released so a queue can build up."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()

    def prepare(self, image):
        return image  # "images" are their keys here

    def encode_prepared(self, images):
        if not self.batches:
            self.gate.wait(10)
        self.batches.append(list(images))
        return [torch.full((4, 8), float(len(self.batches))) for _ in images]


def _submit(cache: EmbeddingCache, worker: VisionWorker, key: str, priority: int):
    fut, produce = cache.acquire(key, want_lease=False)
    if produce:
        worker.submit(key, key, priority)  # the fake vision takes the key as the image
    return fut


def test_demand_before_prefetch_and_batches_of_one_priority():
    vision = _FakeVision()
    cache = EmbeddingCache(TensorArena(1 << 16))
    worker = VisionWorker(vision, cache, max_batch_images=3)
    try:
        futs = [_submit(cache, worker, "first", DEMAND)]  # occupies the worker until the gate opens
        while worker.queued():
            pass
        futs += [_submit(cache, worker, f"p{i}", PREFETCH) for i in range(4)]
        futs += [_submit(cache, worker, f"d{i}", DEMAND) for i in range(2)]
        _submit(cache, worker, "p3", DEMAND)  # a demand request joins queued prefetch p3: boosted
        worker.boost("p3")
        vision.gate.set()
        for f in futs:
            f.result(10)
        assert vision.batches[0] == ["first"]
        assert vision.batches[1] == ["d0", "d1", "p3"], "demand work (and the boosted job) goes first"
        assert vision.batches[2:] == [["p0", "p1", "p2"]]
        assert worker.encodes == 7 and cache.stats().entries == 7
    finally:
        worker.stop()


def test_a_failing_batch_fails_its_waiters_and_the_worker_lives_on():
    class Broken(_FakeVision):
        def encode_prepared(self, images):
            if any(k == "bad" for k in images):
                raise RuntimeError("tower exploded")
            return super().encode_prepared(images)

    vision = Broken()
    vision.gate.set()
    cache = EmbeddingCache(TensorArena(1 << 16))
    worker = VisionWorker(vision, cache)
    try:
        bad = _submit(cache, worker, "bad", DEMAND)
        try:
            bad.result(10)
            raise AssertionError("expected the tower error")
        except RuntimeError as exc:
            assert "tower exploded" in str(exc)
        assert _submit(cache, worker, "good", DEMAND).result(10).entry.key == "good"
    finally:
        worker.stop()
