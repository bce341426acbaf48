"""The vision worker: demand before prefetch, batching by priority, boosting a joined prefetch."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from common.transport.arena import TensorArena
from encoder_svc.cache import EmbeddingCache
from encoder_svc.worker import DEMAND, MAX_PREFETCH_BATCH_IMAGES, PREFETCH, VisionWorker


class _FakeVision:
    """Records each batch; the first batch blocks until released so a queue can build up."""

    device = torch.device("cpu")
    graphs = None  # VisionEncoder's field: no graphs captured

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.graphed: list[bool] = []  # use_graphs per batch
        self.gate = threading.Event()

    def prepare(self, image):
        return image  # "images" are their keys here

    def launch_groups(self, prepared, use_graphs=False):
        return [prepared]  # VisionEncoder's default: the batch is one forward

    def encode_prepared(self, images, use_graphs=False):
        self.graphed.append(use_graphs)
        if not self.batches:
            self.gate.wait(10)
        self.batches.append(list(images))
        return [torch.full((4, 8), float(len(self.batches))) for _ in images]


@contextlib.contextmanager
def _running_worker(vision, arena_bytes: int = 1 << 16,
                    **kwargs) -> Iterator[tuple[EmbeddingCache, VisionWorker]]:
    """A cache and a worker over vision (VisionWorker's keyword arguments), stopped afterwards."""
    cache = EmbeddingCache(TensorArena(arena_bytes))
    worker = VisionWorker(vision, cache, **kwargs)
    try:
        yield cache, worker
    finally:
        worker.stop()


def _submit(cache: EmbeddingCache, worker: VisionWorker, key: str, priority: int):
    fut, produce = cache.acquire(key, want_lease=False)
    if produce:
        worker.submit(key, key, priority)  # the fake vision takes the key as the image
    return fut


def _run_behind_a_busy_first_batch(vision: _FakeVision, worker: VisionWorker, cache: EmbeddingCache,
                                   jobs: list[tuple[str, int]], while_queued=None) -> None:
    """Hold the worker in a first one-image batch, queue jobs (key, priority) behind it (and call
    while_queued() then, if given), then let all of them run and wait for each."""
    futs = [_submit(cache, worker, "first", DEMAND)]
    while worker.queued():
        pass
    futs += [_submit(cache, worker, key, priority) for key, priority in jobs]
    if while_queued is not None:
        while_queued()
    vision.gate.set()
    for f in futs:
        f.result(10)
    _until_idle(worker)


def _until_idle(worker: VisionWorker) -> None:
    """Wait until the worker's thread has ended its batch: a waiter wakes when its rows are stored,
    before the thread counts the batch."""
    deadline = time.monotonic() + 10
    while worker.stalled_for_s() > 0.0:
        assert time.monotonic() < deadline, "the worker never went idle"
        time.sleep(0.001)


def test_demand_before_prefetch_and_batches_of_one_priority():
    vision = _FakeVision()
    with _running_worker(vision, max_batch_images=3) as (cache, worker):
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
        assert vision.graphed == [True, True, False], "CUDA graphs (one stream's) for demand batches only"
        assert worker.encodes == 7 and cache.stats().entries == 7


def test_a_failing_batch_fails_its_waiters_and_the_worker_lives_on():
    class Broken(_FakeVision):
        def encode_prepared(self, images, use_graphs=False):
            if any(k == "bad" for k in images):
                raise RuntimeError("tower exploded")
            return super().encode_prepared(images, use_graphs)

    vision = Broken()
    vision.gate.set()
    with _running_worker(vision) as (cache, worker):
        bad = _submit(cache, worker, "bad", DEMAND)
        try:
            bad.result(10)
            raise AssertionError("expected the tower error")
        except RuntimeError as exc:
            assert "tower exploded" in str(exc)
        assert _submit(cache, worker, "good", DEMAND).result(10).entry.key == "good"


def test_batches_follow_the_queue_up_to_max_batch_images():
    vision = _FakeVision()
    with _running_worker(vision, max_batch_images=4) as (cache, worker):
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(6)])
        # one image alone while idle; then all that queued, capped at 4; then the rest
        assert vision.batches == [["first"], ["d0", "d1", "d2", "d3"], ["d4", "d5"]]


def test_a_demand_batch_is_cut_to_a_graph_size_rather_than_padded_by_more_than_a_quarter():
    from common.vision.graphs import GraphedForward

    vision = _FakeVision()
    vision.graphs = GraphedForward.__new__(GraphedForward)  # its batch sizes only: nothing captured
    vision.graphs.buckets = [1, 2, 4, 8, 16, 32]
    with _running_worker(vision, max_batch_images=32, arena_bytes=1 << 20) as (cache, worker):
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(19)]
                                       + [(f"p{i}", PREFETCH) for i in range(3)])  # prefetch: never cut
        # 19 waiting would run padded to 32: 16 run, then the 3 left (a graph of 4, one pad)
        assert [len(b) for b in vision.batches] == [1, 16, 3, 3]
        assert vision.batches[3] == ["p0", "p1", "p2"]


def test_graph_batch_size_wastes_at_most_a_quarter_of_a_graph_on_padding():
    from common.vision.graphs import GraphedForward

    graphs = GraphedForward.__new__(GraphedForward)
    graphs.buckets = [1, 2, 4, 8, 16, 32]
    sizes = {n: graphs.batch_size(n) for n in range(1, 33)}
    assert sizes[17] == 16 and sizes[24] == 24 and sizes[5] == 4 and sizes[3] == 3 and sizes[32] == 32
    for n, size in sizes.items():
        assert 1 <= size <= n
        assert 4 * (graphs.bucket(size) - size) <= graphs.bucket(size), (n, size)


class _PrepVision(_FakeVision):
    """Preparation runs in pool threads: records them, fails "bad", signals each key prepared."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.prepared: dict[str, threading.Event] = {}

    def prepare(self, image):
        self.threads.add(threading.current_thread().name)
        if image == "bad":
            raise ValueError("cannot preprocess")
        self.prepared.setdefault(image, threading.Event()).set()
        return image


def test_preprocessing_is_off_the_tower_thread_and_overlaps_it():
    vision = _PrepVision()
    for key in ("first", "next"):
        vision.prepared[key] = threading.Event()
    with _running_worker(vision, preprocess_threads=2) as (cache, worker):
        first = _submit(cache, worker, "first", DEMAND)
        while worker.queued():  # the tower thread took "first" and is held in the tower by the gate
            pass
        nxt = _submit(cache, worker, "next", DEMAND)
        # "next" gets prepared while the tower is still busy with "first"
        assert vision.prepared["next"].wait(10) and not first.done()
        vision.gate.set()
        first.result(10), nxt.result(10)
        assert vision.threads and all(name.startswith("vision-prep") for name in vision.threads)


def test_a_bad_image_fails_alone_and_its_batch_runs():
    vision = _PrepVision()
    vision.gate.set()
    with _running_worker(vision) as (cache, worker):
        with worker.holding():
            bad = _submit(cache, worker, "bad", DEMAND)
            good = _submit(cache, worker, "good", DEMAND)
        assert good.result(10).entry.key == "good"
        try:
            bad.result(10)
            raise AssertionError("expected the preprocessing error")
        except ValueError as exc:
            assert "cannot preprocess" in str(exc)
        assert vision.batches == [["good"]]


def test_prefetch_batches_stay_small_so_demand_never_waits_long_behind_one():
    vision = _FakeVision()
    with _running_worker(vision, max_batch_images=32, arena_bytes=1 << 20) as (cache, worker):
        futs = [_submit(cache, worker, "first", DEMAND)]
        while worker.queued():
            pass
        futs += [_submit(cache, worker, f"p{i}", PREFETCH) for i in range(MAX_PREFETCH_BATCH_IMAGES + 2)]
        futs += [_submit(cache, worker, f"d{i}", DEMAND) for i in range(12)]
        # a prefetch batch takes only prepared jobs: on a loaded machine the preparations may lag, so
        # wait for all of them (the batch sizes are the contract here, not the preparation's speed)
        with worker.holding():
            prepared = [job.prepared for job in worker._jobs.values()]
        for done in prepared:
            done.result(10)
        vision.gate.set()
        for f in futs:
            f.result(10)
        assert [len(b) for b in vision.batches] == [1, 12, MAX_PREFETCH_BATCH_IMAGES, 2]


class _Event:
    """A stand-in CUDA event: done after `polls` queries (never, with None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_the_gpu_fence_waits_for_the_oldest_batch_but_never_past_its_bound():
    import time

    from encoder_svc import worker as worker_module

    with _running_worker(_FakeVision(), max_batch_images=4) as (cache, worker):
        finishes, newer = _Event(polls=3), _Event(polls=None)
        # A bound of 1.5 s for the batch that finishes on its 4th query: a loaded CI host's sleeps
        # cannot run it out first (3 ms did: 3 queries, then the bound).
        worker._in_flight.extend([(finishes, 1000), (newer, 2)])
        worker._wait_for_device()
        assert finishes.queries == 4 and list(worker._in_flight) == [(newer, 2)]

        stuck = _Event(polls=None)  # e.g. queued behind another process's work on a shared GPU
        worker._in_flight.append((stuck, 8))
        t0 = time.monotonic()
        worker._wait_for_device()
        waited = time.monotonic() - t0
        assert waited >= 2 * worker_module.FENCE_S_PER_IMAGE  # `newer` (2 images) held it that long
        assert waited < 10 * 8 * worker_module.FENCE_S_PER_IMAGE + 1.0, "bounded, not until done"
        assert len(worker._in_flight) == 1


def test_the_gpu_fence_lets_a_full_batch_go_at_once():
    vision = _FakeVision()
    stuck = _Event(polls=None)

    def wait_with_a_full_batch_queued() -> None:
        worker._in_flight.extend([(stuck, 1000), (_Event(polls=None), 1)])  # a bound of 1.5 s
        worker._wait_for_device()  # returns at once: a full batch waits

    with _running_worker(vision, max_batch_images=4) as (cache, worker):
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(4)],
                                       wait_with_a_full_batch_queued)
        assert stuck.queries == 1


def test_an_abandoned_demand_job_asked_for_again_as_prefetch_does_not_stall_the_queue():
    """Seen on the H200 (a 96-client soak, once the cache evicted hot images): an image's demand job is
    dropped by its callers while queued, and the same image comes back as a lookahead. The old job must
    not stay queued as a demand job that the count of waiting demand jobs leaves out: a demand batch sized
    by that count (Qwen-VL's tower graphs) took nothing, and the tower thread looped, running no batch."""

    class _ExactGraphs:  # Qwen-VL's TowerGraphs.batch_size: every waiting demand image
        def batch_size(self, waiting: int) -> int:
            return waiting

    vision = _FakeVision()
    vision.graphs = _ExactGraphs()
    with _running_worker(vision, preprocess_threads=1) as (cache, worker):
        first = _submit(cache, worker, "first", DEMAND)  # holds the tower until the gate opens
        while worker.queued():
            pass
        gone = _submit(cache, worker, "img", DEMAND)
        assert gone.cancel()
        while cache.abandoned == 0:  # its preparation found nobody waiting: the production is dropped
            pass
        again = _submit(cache, worker, "img", PREFETCH)
        vision.gate.set()
        first.result(10)
        assert again.result(10).entry.key == "img"
        assert vision.batches == [["first"], ["img"]]
        # The result is out before the tower thread closes its batch's books: give it that moment (the
        # old bug kept the job queued and the tower looping, so this would run out).
        deadline = time.monotonic() + 10
        while (worker.stalled_for_s() or worker.queued()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.stalled_for_s() == 0.0 and worker.queued() == 0


def test_a_boosted_job_is_prepared_on_the_demand_threads_when_lookahead_preparation_is_backed_up():
    """The lookahead threads are all busy (a slow preparation holds them): a queued lookahead image that a
    demand request joins is prepared by a demand thread instead of waiting its turn there, and runs."""

    class _SlowPrefetchPrep(_FakeVision):
        def __init__(self) -> None:
            super().__init__()
            self.gate.set()
            self.prep_gate = threading.Event()

        def prepare(self, image):
            if image == "slow":
                assert self.prep_gate.wait(10)
            return image

    vision = _SlowPrefetchPrep()
    with _running_worker(vision, preprocess_threads=2) as (cache, worker):  # one lookahead prep thread
        slow = _submit(cache, worker, "slow", PREFETCH)
        while not worker._pools[PREFETCH]._queue.empty():  # the lookahead thread has taken it
            pass
        wanted = _submit(cache, worker, "wanted", PREFETCH)  # queued behind it on that thread
        _submit(cache, worker, "wanted", DEMAND)  # a demand request joins it
        worker.boost("wanted")
        assert wanted.result(10).entry.key == "wanted"
        assert not slow.done()
        vision.prep_gate.set()
        slow.result(10)


def test_the_tower_thread_accounts_every_batch_in_its_phases():
    """GetStats' tower_thread_seconds: every batch (a failed one too) adds each phase once."""
    from encoder_svc.stages import TOWER_THREAD_PHASES

    class SometimesBroken(_FakeVision):
        def encode_prepared(self, images, use_graphs=False):
            if "bad" in images:
                raise RuntimeError("tower exploded")
            return super().encode_prepared(images, use_graphs)

    vision = SometimesBroken()
    with _running_worker(vision, max_batch_images=4) as (cache, worker):
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(6)])
        bad = _submit(cache, worker, "bad", DEMAND)
        with contextlib.suppress(RuntimeError):
            bad.result(10)
        _until_idle(worker)
        seconds, batches = worker.thread_times.snapshot()
        assert worker.batches == 3 and batches == 4, "the failed batch is counted too"
        assert set(seconds) == set(TOWER_THREAD_PHASES)
        assert all(s >= 0.0 for s in seconds.values())
        assert seconds["launch"] > 0.0 and seconds["idle"] > 0.0


def test_a_batch_invariant_worker_runs_each_image_through_a_forward_of_its_own():
    """--deterministic: the batch still groups the queued work, but every image is its own forward."""
    vision = _FakeVision()
    with _running_worker(vision, max_batch_images=4, batch_invariant=True) as (cache, worker):
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(6)])
        assert vision.batches == [["first"]] + [[f"d{i}"] for i in range(6)]
        assert worker.batches == 3, "three batches (1, 4, 2 images) of one-image forwards"
        assert all(vision.graphed), "demand forwards still replay graphs"


def test_each_run_of_a_batch_is_handed_over_before_the_next_is_launched():
    """A batch the encoder runs in several forwards (launch_groups: its graphs' sizes) hands each run's
    rows to the cache as soon as that run is launched: the first images of a large batch do not wait for
    the last ones' launch (which, on a busy GPU, waits for room in the device's queue)."""

    class Runs(_FakeVision):
        def __init__(self) -> None:
            super().__init__()
            self.done_before: list[list[str]] = []
            self.cache = None

        def launch_groups(self, prepared, use_graphs=False):
            return [prepared[i:i + 2] for i in range(0, len(prepared), 2)]

        def encode_prepared(self, images, use_graphs=False):
            ready = [k for k in ("d0", "d1", "d2", "d3", "d4") if self.cache.peek(k) is not None]
            self.done_before.append(ready)
            return super().encode_prepared(images, use_graphs)

    vision = Runs()
    with _running_worker(vision, max_batch_images=8) as (cache, worker):
        vision.cache = cache
        _run_behind_a_busy_first_batch(vision, worker, cache, [(f"d{i}", DEMAND) for i in range(5)])
        assert vision.batches == [["first"], ["d0", "d1"], ["d2", "d3"], ["d4"]]
        assert vision.done_before[1:] == [[], ["d0", "d1"], ["d0", "d1", "d2", "d3"]]
        assert worker.batches == 2 and worker.encodes == 6
