"""Images whose every caller has gone (issue 38, item 2): the vision worker neither prepares nor encodes
them (it stops at the next image boundary), without failing anyone; an image that another caller joined
meanwhile is still made. Counted in prepare and tower calls, never timed."""

from __future__ import annotations

import threading

from encoder_svc.worker import DEMAND
from tests.encoder.test_worker import _FakeVision, _running_worker, _submit


class _CountingVision(_FakeVision):
    """Records each image prepared; the first one's preparation waits until `prep_gate` opens, so that
    the images behind it on the one prep thread are still unprepared when their callers leave."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[str] = []
        self.prep_gate = threading.Event()

    def prepare(self, image):
        if image == "first":
            self.prep_gate.wait(10)
        self.prepared.append(image)
        return image


def test_images_whose_callers_left_are_neither_prepared_nor_encoded() -> None:
    vision = _CountingVision()
    with _running_worker(vision, max_batch_images=8, preprocess_threads=1) as (cache, worker):
        first = _submit(cache, worker, "first", DEMAND)
        while worker.queued():  # the tower took "first" and waits for its preparation
            pass
        gone = [_submit(cache, worker, f"gone{i}", DEMAND) for i in range(3)]
        joined = _submit(cache, worker, "joined", DEMAND)
        kept = _submit(cache, worker, "kept", DEMAND)
        for fut in [*gone, joined]:
            assert fut.cancel()
        rejoined = _submit(cache, worker, "joined", DEMAND)  # another caller joins the production
        vision.prep_gate.set()
        vision.gate.set()
        for fut in (first, kept, rejoined):
            fut.result(10)
        assert sorted(vision.prepared) == ["first", "joined", "kept"]
        assert sorted(key for batch in vision.batches for key in batch) == ["first", "joined", "kept"]
        assert cache.abandoned == 3 and cache.stats().entries == 3
        # An abandoned image asked for again is made afresh.
        assert _submit(cache, worker, "gone0", DEMAND).result(10).entry.key == "gone0"
