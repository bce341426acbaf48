"""The vision worker: preprocessing pools feeding one thread that batches queued images and runs the tower.

A video is one job like an image (encoder_svc/videos.py): it comes here decoded and patched by the video
lane (video_lane.py), and the tower runs it with its (t, h, w) grid, in a batch with images or videos.
A job whose every caller has gone (cache.still_wanted) is neither prepared nor run through the tower.

Each image starts preprocessing (`VisionEncoder.prepare`) in a thread pool (one per priority) the
moment it is submitted, so that work runs in parallel and the next batch is prepared while the tower
runs the current one; the tower thread only stacks prepared images and launches the forward pass.

Demand work goes before prefetch (lookahead) work: a priority queue ordered by (priority, arrival).
A batch holds jobs of one priority only, so on a GPU a demand batch runs on the high-priority CUDA
stream and a prefetch batch on the low-priority side stream; demand batches replay the tower's CUDA
graphs (graphs.py), whose buffers belong to one stream. A demand request that joins a queued prefetch
job boosts it to demand priority, and its preparation to the demand threads if none has begun it.
A prefetch batch takes only jobs already prepared: the tower thread waits for a batch's preparations,
and a demand image must not wait behind a lookahead image's.

The batch follows the load: the tower thread takes every queued job of the head priority, up to
`max_batch_images` (prefetch batches: up to 8, so a demand image never waits long behind one), without
waiting for more to arrive. One queued image runs alone at once (lowest
latency); under load the queue grows while the tower is busy and the next batch is larger. A demand
batch is cut to a captured graph size when padding would waste more than a quarter of its graph
(`GraphedForward.batch_size`).

On a GPU the tower's work is asynchronous, so "while the tower is busy" needs a fence: the thread keeps
at most `MAX_BATCHES_IN_FLIGHT` batches launched and not yet finished on the device, and waits for the
oldest before it takes another. Without it the thread launches a tiny batch for every few images
that arrive and the GPU works through a long queue of them (a full batch runs many more images a second
than small ones: BENCHMARKS.md); with it, images queue on the host while
the GPU runs the current batch and the one launched behind it, and the next batch takes them all.
The wait is bounded: it ends once a full batch is waiting, or after `FENCE_S_PER_IMAGE` per image of
the oldest batch (more than the tower needs for it), so a GPU shared with another process (a
decoder whose reads of the cache fence our next writes) cannot hold the thread, and with it the
replies and the cache admissions of the next images, for longer than the batch's own work.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from PIL import Image

from common.families.encoder import VisionEncoder
from common.image_geometry import ImageSettings
from common.stage_totals import StageTotals
from common.thread_names import set_native_thread_name
from encoder_svc.cache import EmbeddingCache, ProductionAbandoned, ShuttingDownError
from encoder_svc.decoded_image import DecodedImage
from encoder_svc.defaults import DEFAULT_MAX_BATCH_IMAGES, default_preprocess_threads
from encoder_svc.memory_return import input_nbytes, return_memory_after
from encoder_svc.prep_threads import PrepTask, PrepThreads
from encoder_svc.stages import TOWER_THREAD_PHASES, JobTimes
from encoder_svc.videos import VideoJob

log = logging.getLogger(__name__)

DEMAND = 0
MAX_PREFETCH_BATCH_IMAGES = 8
PREFETCH = 1
# Batches launched on the GPU and not yet finished before the tower thread waits: two keep the GPU busy
# (the next batch is launched while the current one runs) and let the queue grow meanwhile.
MAX_BATCHES_IN_FLIGHT = 2
FENCE_S_PER_IMAGE = 0.0015  # the longest wait for the oldest batch, per image in it (CLIP-L/336: ~1 ms)
FENCE_POLL_S = 0.001
KEPT_JOB_TIMES = 4096  # the stamps of the last jobs, for the Encodes that waited on them (stages.py)


@dataclass
class _Job:
    key: str
    prepared: PrepTask  # VisionEncoder.prepare(image), running on a prep thread
    priority: int
    times: JobTimes
    stale: bool = False


class VisionWorker:
    """Runs queued images through `vision` in batches and stores results in `cache`."""

    def __init__(self, vision: VisionEncoder, cache: EmbeddingCache,
                 max_batch_images: int = DEFAULT_MAX_BATCH_IMAGES,
                 preprocess_threads: int | None = None, batch_invariant: bool = False) -> None:
        self.vision = vision
        # --deterministic: each image (or video) of a batch through its own forward, so that its rows
        # never depend on which others shared the batch (the products' kernels and reduction order
        # follow the row count); the batch still orders and fences the work.
        self.batch_invariant = batch_invariant
        self.cache = cache
        self.max_batch_images = max(1, max_batch_images)
        # A demand image that arrives while a prefetch batch runs waits for all of it: kernels already
        # launched are not preempted by the high-priority stream. Small prefetch batches bound that wait
        # (BENCHMARKS.md has lookahead on and off at both batch sizes).
        self.max_prefetch_batch = min(self.max_batch_images, MAX_PREFETCH_BATCH_IMAGES)
        threads = preprocess_threads or default_preprocess_threads()
        # One pool per priority: a demand image never queues behind a burst of prefetch images (both
        # share the cores; prefetch gets half the threads).
        self._cv = threading.Condition()  # re-entrant: see holding()
        # A lookahead job is taken only once prepared (_next_batch): the end of a lookahead preparation
        # wakes the tower thread (a demand batch waits on its own preparations: no wake needed there).
        self._pools = {DEMAND: PrepThreads(threads, "vision-prep"),
                       PREFETCH: PrepThreads(max(1, threads // 2), "vision-prep-lo", after_task=self._wake)}
        self._heap: list[tuple[int, int, _Job]] = []
        self._jobs: dict[str, _Job] = {}
        self._seq = itertools.count()
        self._stopped = False
        self.batches = 0
        self._batch_since: float | None = None  # monotonic start of the batch in progress
        self._progress_at = time.monotonic()  # the tower's last step: a batch taken or ended, or work owed
        self.encodes = 0
        self.busy_s = 0.0
        self.started_at = time.monotonic()
        self._streams: dict[int, object] = {}
        self._in_flight: deque = deque()  # (CUDA event, images) of launched batches, oldest first
        self._times: OrderedDict[str, JobTimes] = OrderedDict()
        self._device_timers: deque = deque()  # (start, end) CUDA events of batches not yet read
        self._device_lock = threading.Lock()
        self._tower_gpu_s = 0.0
        self.thread_times = StageTotals(TOWER_THREAD_PHASES)  # per batch: where the tower thread waited
        if vision.device.type == "cuda":
            # Lower number = higher priority; 0 is the default (lowest) priority.
            low, high = torch.cuda.Stream.priority_range()
            self._streams[DEMAND] = torch.cuda.Stream(vision.device, priority=min(low, high))
            self._streams[PREFETCH] = torch.cuda.Stream(vision.device, priority=max(low, high))
        self._thread = threading.Thread(target=self._run, name="vision-worker", daemon=True)
        self._thread.start()

    def submit(self, key: str, image: Image.Image | DecodedImage | VideoJob, priority: int = DEMAND,
               pixels: ImageSettings | None = None) -> None:
        """Queue image (PIL, or raw pixels from the decode pool) or a video job for key; the cache gets
        `complete(key, ...)` or `fail(key, ...)` later. pixels: the image's settings (a Qwen-VL pixel
        range, a Gemma 3 crop choice)."""
        with self._cv:
            if self._stopped:
                if isinstance(image, DecodedImage):
                    image.release()
                self.cache.fail(key, ShuttingDownError("encoder shutting down"))
                return
            if not self._jobs and self._batch_since is None:
                self._progress_at = time.monotonic()  # an idle tower owes work from now on
            times = JobTimes(submitted=time.perf_counter())
            prepare = functools.partial(self._prepare_timed, times=times, pixels=pixels, key=key)
            job = _Job(key, self._pools[priority].submit(prepare, image), priority, times)
            # A key is produced again only after its last production was dropped (every caller gone, or
            # failed): a job of it still queued is dead. It must not stay in the heap as a job that
            # `_jobs` no longer counts (a demand batch sized by the count would take nothing).
            old = self._jobs.get(key)
            if old is not None:
                old.stale = True
            self._jobs[key] = job
            self._times[key] = times
            while len(self._times) > KEPT_JOB_TIMES:
                self._times.popitem(last=False)
            heapq.heappush(self._heap, (priority, next(self._seq), job))
            self._cv.notify()

    def _prepare_timed(self, image: Image.Image | DecodedImage | VideoJob, times: JobTimes,
                       pixels: ImageSettings | None = None, key: str | None = None):
        """_prepare, stamped."""
        times.prep_start = time.perf_counter()
        try:
            return self._prepare(image, pixels, key)
        finally:
            times.prep_end = time.perf_counter()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def job_times(self, key: str) -> JobTimes | None:
        """The stamps of the latest job for key (None once forgotten: only the last jobs are kept)."""
        with self._cv:
            return self._times.get(key)

    @property
    def tower_gpu_s(self) -> float:
        """Device seconds of the tower batches finished so far (CUDA events; 0 on a CPU)."""
        self._collect_device_times()
        return self._tower_gpu_s

    def _collect_device_times(self) -> None:
        with self._device_lock:
            while self._device_timers and self._device_timers[0][1].query():
                start, end = self._device_timers.popleft()
                self._tower_gpu_s += start.elapsed_time(end) / 1000

    def _prepare(self, image: Image.Image | DecodedImage | VideoJob, pixels: ImageSettings | None = None,
                 key: str | None = None):
        """The tower's host-side preprocessing (a video: decoding its sampled frames and patching them);
        then a decode pool's pixel slot goes back (prepare copied the pixels out). Nothing is prepared
        for a key whose every caller has gone (ProductionAbandoned)."""
        if isinstance(image, VideoJob):
            return image.prepare()
        try:
            if key is not None and not self.cache.still_wanted(key):
                raise ProductionAbandoned(key)
            return self.vision.prepare(image) if pixels is None else self.vision.prepare(image, pixels)
        finally:
            if isinstance(image, DecodedImage):
                image.release()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Submit several jobs as one: the worker takes none of them until the block ends, so the
        images of one request land in one batch instead of racing the worker one by one."""
        with self._cv:  # a re-entrant lock: submit() inside the block takes it again
            yield

    def boost(self, key: str) -> None:
        """Move a queued prefetch job for key to demand priority (a demand request joined it), and its
        preparation, if no thread has taken it yet, to the demand pool's queue too: the demand batch waits
        for it, and behind a backlog of lookahead preparations it would wait long."""
        with self._cv:
            job = self._jobs.get(key)
            if job is None or job.priority == DEMAND:
                return
            job.stale = True
            fresh = _Job(key, job.prepared, DEMAND, job.times)
            self._jobs[key] = fresh
            heapq.heappush(self._heap, (DEMAND, next(self._seq), fresh))
            self._pools[DEMAND].take_over(job.prepared)

    def queued(self) -> int:
        """Jobs waiting for the tower."""
        with self._cv:
            return len(self._jobs)

    def _next_batch(self) -> list[_Job] | None:
        """The next batch: demand jobs (prepared or not: the thread waits for their preparation), else
        lookahead jobs already prepared; None once stopped. Waits while neither is there."""
        with self._cv:
            while True:
                while self._heap and self._heap[0][2].stale:
                    heapq.heappop(self._heap)
                if self._stopped:
                    return None
                if self._heap and self._heap[0][0] == DEMAND:
                    return self._take_demand_batch()
                batch = self._take_prepared_prefetch_batch()
                if batch:
                    return batch
                self._cv.wait()  # a submit, or a preparation that ends (_prepare_timed), wakes it

    def _take_demand_batch(self) -> list[_Job]:
        limit = self.max_batch_images
        graphs = self.vision.graphs
        if graphs is not None:  # demand batches replay the graphs
            # the head is a demand job, so at least one: a limit of 0 would spin here, taking none
            limit = graphs.batch_size(max(1, min(self._demand_waiting(), limit)))
        batch: list[_Job] = []
        while self._heap and len(batch) < limit and self._heap[0][0] == DEMAND:
            _, _, job = heapq.heappop(self._heap)
            if not job.stale:
                batch.append(self._taken(job))
        return batch

    def _take_prepared_prefetch_batch(self) -> list[_Job]:
        """Up to max_prefetch_batch queued lookahead jobs whose preparation has ended, oldest first
        (called when no demand job is queued). Never one still being prepared: the tower thread would
        wait for it, and a demand image arriving meanwhile would wait behind that preparation."""
        entries = sorted(entry for entry in self._heap if not entry[2].stale)
        ready = [entry for entry in entries if entry[2].prepared.done()][:self.max_prefetch_batch]
        if not ready:
            return []
        taken = {id(entry[2]) for entry in ready}
        self._heap = [entry for entry in entries if id(entry[2]) not in taken]  # sorted: a valid heap
        return [self._taken(job) for _, _, job in ready]

    def _taken(self, job: _Job) -> _Job:
        if self._jobs.get(job.key) is job:  # an abandoned key may be in production again
            del self._jobs[job.key]
        return job

    def _run(self) -> None:
        set_native_thread_name("vision-worker")
        while True:
            idle_from = time.perf_counter()
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                phases = {"idle": time.perf_counter() - idle_from}
                self._batch_since = self._progress_at = time.monotonic()
                ran = False
                try:
                    ran = self._run_batch(batch, phases)
                    fence_from = time.perf_counter()
                    self._wait_for_device()
                    phases["fence"] = time.perf_counter() - fence_from
                    self._collect_device_times()
                finally:
                    # counted with its phases, so the stats never show a batch without its split; and
                    # before the batch ends, so that an idle worker (stalled_for_s() == 0) has counted it
                    self.thread_times.add(phases)
                    if ran:
                        self.batches += 1
                    self._batch_since = None
                    self._progress_at = time.monotonic()

    def stalled_for_s(self) -> float:
        """Seconds the tower has owed work without a step: since the batch in progress began (preparing
        its inputs included), or, with jobs queued and none running, since the last batch ended or the
        first job reached an idle tower. 0 when idle. A watchdog reads it (encoder_svc/stall.py), so it
        takes no lock: a stuck tower thread may hold one."""
        owed = self._batch_since is not None or len(self._jobs) > 0
        return time.monotonic() - self._progress_at if owed else 0.0

    def _wait_for_device(self) -> None:
        """Wait (bounded: see the module docstring) until fewer than MAX_BATCHES_IN_FLIGHT launched
        batches are unfinished on the GPU."""
        while len(self._in_flight) >= MAX_BATCHES_IN_FLIGHT:
            done, images = self._in_flight.popleft()
            deadline = time.monotonic() + images * FENCE_S_PER_IMAGE
            while not done.query() and time.monotonic() < deadline and not self._full_batch_waiting():
                time.sleep(FENCE_POLL_S)

    def _full_batch_waiting(self) -> bool:
        with self._cv:
            return self._demand_waiting() >= self.max_batch_images

    def _demand_waiting(self) -> int:
        """Demand jobs queued for the tower (call holding the lock)."""
        return sum(1 for job in self._jobs.values() if job.priority == DEMAND)

    def _prepared(self, batch: list[_Job]) -> list[tuple[_Job, object]]:
        """(job, prepared image) for the batch's jobs whose preprocessing succeeded; the others fail."""
        out = []
        for job in batch:
            try:
                prepared = job.prepared.result()
            except ProductionAbandoned:  # dropped by the cache: neither complete nor fail it
                continue
            except Exception as exc:  # a bad image fails its own key, not its batch
                log.warning("preprocessing %s failed: %s", job.key[:16], exc)
                self.cache.fail(job.key, exc)
                continue
            if self.cache.still_wanted(job.key):  # not when everyone left while it was prepared
                out.append((job, prepared))
        return out

    def _run_batch(self, jobs: list[_Job], phases: dict[str, float]) -> bool:
        """Run jobs' prepared inputs through the tower and store the rows; phases gains the seconds this
        thread waited for the preparations and spent launching and storing. True when the tower ran the
        batch through (False: nothing was left to run, or it failed)."""
        waited_from = time.perf_counter()
        batch = self._prepared(jobs)
        phases["prepare_wait"] = time.perf_counter() - waited_from
        if not batch:
            return False
        ran = False
        t0 = time.monotonic()
        stream = self._streams.get(batch[0][0].priority)
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    self._encode_and_store(batch, phases)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(stream)
                    self._in_flight.append((done, len(batch)))
                    with self._device_lock:
                        self._device_timers.append((start, done))
            else:
                self._encode_and_store(batch, phases)
            ran = True
        except Exception as exc:  # the tower failed: every job of the batch fails, the worker lives on
            log.exception("vision batch of %d failed", len(batch))
            for job, _ in batch:
                self.cache.fail(job.key, exc)
        self.busy_s += time.monotonic() - t0
        nbytes = sum(input_nbytes(prepared) for _, prepared in batch)
        del batch
        for job in jobs:
            job.prepared = None  # the inputs go now, so that a large batch's memory can be given back
        return_memory_after(nbytes)
        return ran

    def _encode_and_store(self, batch: list[tuple[_Job, object]], phases: dict[str, float]) -> None:
        """The batch's forwards, run by run (VisionEncoder.launch_groups; one image each when batch
        invariant), each run's rows handed to the cache as soon as it is launched: on a busy GPU a launch
        waits for room in the device's queue, and the first images of a large batch need not wait for
        the last ones' launch."""
        graphs = batch[0][0].priority == DEMAND  # graphs for demand batches only: one stream's (graphs.py)
        phases.setdefault("launch", 0.0)
        phases.setdefault("store", 0.0)
        for group in self._launch_groups(batch, graphs):
            started = time.perf_counter()
            for job, _ in group:
                job.times.tower_start = started
            feats = self.vision.encode_prepared([prepared for _, prepared in group], use_graphs=graphs)
            launched = time.perf_counter()
            phases["launch"] += launched - started
            for job, _ in group:  # before complete_many: an Encode woken by it reads the stamps
                job.times.tower_end = launched
            self.encodes += len(group)
            grids = [getattr(prepared, "grid", ()) for _, prepared in group]  # Qwen-VL images have one
            timings = [getattr(prepared, "timing", None) for _, prepared in group]  # videos have one
            items = [(job.key, feat) for (job, _), feat in zip(group, feats, strict=True)]
            self.cache.complete_many(items, grids, timings)
            phases["store"] += time.perf_counter() - launched

    def _launch_groups(self, batch: list[tuple[_Job, object]],
                       graphs: bool) -> list[list[tuple[_Job, object]]]:
        """The batch in the runs its forwards take: one item each when batch invariant, else the
        encoder's launch_groups (consecutive runs, in order)."""
        if self.batch_invariant:
            return [[item] for item in batch]
        groups, start = [], 0
        for run in self.vision.launch_groups([prepared for _, prepared in batch], graphs):
            groups.append(batch[start:start + len(run)])
            start += len(run)
        if start != len(batch):
            raise RuntimeError(f"launch_groups covered {start} of {len(batch)} inputs")
        return groups

    def images_per_s(self) -> float:
        """Images through the tower per second since the worker started."""
        return self.encodes / max(time.monotonic() - self.started_at, 1e-9)

    def stop(self) -> None:
        """Stop after the current batch; queued jobs fail (their callers get UNAVAILABLE)."""
        with self._cv:
            self._stopped = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._heap.clear()
            self._cv.notify_all()
        for job in jobs:
            self.cache.fail(job.key, ShuttingDownError("encoder shutting down"))
        self._thread.join(timeout=30)
        for pool in self._pools.values():
            pool.shutdown()
