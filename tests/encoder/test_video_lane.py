"""The video lane on its own (no server): a video decodes on the lane's threads and goes to the worker
decoded; its decoding stops at the next frame when the encoder shuts down, leaving the key for the
cache's close to fail (UNAVAILABLE), and a bad stream fails its key. Counted in frames, never timed."""

from __future__ import annotations

import threading

import pytest

from common.errors import UnavailableError
from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO
from common.transport.arena import TensorArena
from common.video.limits import VideoLimits
from common.video.pipeline import plan_video
from encoder_svc.cache import EmbeddingCache
from encoder_svc.video_lane import VideoLane
from encoder_svc.videos import VideoJob
from encoder_svc.worker import DEMAND, PREFETCH
from tests.video.media import make_video

CONFIG = QWEN2_VL_VIDEO.with_request(max_frames=4)
LONG = make_video(600, fps=10, gop_size=10000, still=True)  # frames 0..450 decoded for 4 sampled
# ... with no bound per frame kept (that bound: tests/video/test_decode_bound.py): the lane's heavy load.
UNBOUNDED = VideoLimits(max_decode_per_frame=0)
WAIT_S = 30.0


def _job(data: bytes = LONG, limits: VideoLimits = UNBOUNDED) -> VideoJob:
    return VideoJob(data, CONFIG, limits, plan_video(data, CONFIG, "fp", limits=limits))


def _lane(cache: EmbeddingCache):
    submitted: list[tuple[str, VideoJob, int]] = []
    arrived = threading.Event()

    def submit(key: str, job: VideoJob, priority: int) -> None:
        submitted.append((key, job, priority))
        arrived.set()

    return VideoLane(cache, submit, threads=1), submitted, arrived


def _hold_at_frame_5(lane: VideoLane) -> tuple[threading.Event, threading.Event]:
    """(at_frame_5, go): decoding stops before its fifth frame, says so in at_frame_5, goes on at go."""
    at_frame_5, go = threading.Event(), threading.Event()
    real = lane._frame_decoded

    def held(key: str) -> bool:
        if lane.frames_decoded == 4:
            at_frame_5.set()
            assert go.wait(WAIT_S)
        return real(key)

    lane._frame_decoded = held
    return at_frame_5, go


def test_a_video_reaches_the_worker_decoded() -> None:
    cache = EmbeddingCache(TensorArena(1 << 16))
    lane, submitted, arrived = _lane(cache)
    fut, produce = cache.acquire("k", want_lease=False, video=True)
    lane.start("k", _job(), 0)
    assert arrived.wait(WAIT_S)
    (key, job, priority), = submitted
    assert key == "k" and job.prepared is not None and tuple(job.prepared.grid) == tuple(job.plan.grid)
    assert job.prepare() is job.prepared  # the worker's prep thread does no decoding
    assert lane.frames_decoded == job.plan.frames_to_decode == 451
    lane.shutdown()


def test_shutting_down_stops_decoding_at_the_next_frame() -> None:
    cache = EmbeddingCache(TensorArena(1 << 16))
    lane, submitted, _ = _lane(cache)
    at_frame_5, go = _hold_at_frame_5(lane)
    finished = threading.Event()
    run = lane._run
    lane._run = lambda item: (run(item), finished.set())
    fut, _ = cache.acquire("k", want_lease=False, video=True)
    lane.start("k", _job(), 0)
    assert at_frame_5.wait(WAIT_S)
    lane.shutdown()
    go.set()
    assert finished.wait(WAIT_S)
    assert lane.frames_decoded == 5 and not submitted and lane.abandoned == 0
    cache.close()  # as the server closes next: the key left pending fails
    with pytest.raises(UnavailableError, match="shutting down"):
        fut.result(WAIT_S)


def test_a_video_that_breaks_while_decoding_fails_its_key() -> None:
    cache = EmbeddingCache(TensorArena(1 << 16))
    lane, submitted, _ = _lane(cache)
    fut, _ = cache.acquire("k", want_lease=False, video=True)
    spent = VideoLimits(max_decode_s=1e-9, max_decode_per_frame=0)  # spent at the first frame
    lane.start("k", _job(limits=spent), 0)
    with pytest.raises(Exception, match="--max-video-decode-seconds"):
        fut.result(WAIT_S)
    assert not submitted
    lane.shutdown()


def test_a_video_needed_now_while_it_decodes_goes_to_the_tower_as_demand_work() -> None:
    """A demand caller joins a looked-ahead video still decoding here: the worker has no job of it to raise
    yet, so the lane hands it over at demand priority once decoded; a video that has left the lane is
    the worker's to raise (boost answers False)."""
    cache = EmbeddingCache(TensorArena(1 << 16))
    lane, submitted, arrived = _lane(cache)
    at_frame_5, go = _hold_at_frame_5(lane)
    cache.acquire("k", want_lease=False, video=True)
    lane.start("k", _job(), PREFETCH)
    assert at_frame_5.wait(WAIT_S)
    assert lane.boost("k")
    go.set()
    assert arrived.wait(WAIT_S)
    assert [(key, priority) for key, _, priority in submitted] == [("k", DEMAND)]
    assert not lane.boost("k")  # with the worker now
    lane.shutdown()


@pytest.mark.parametrize("ending", ["ask cancelled", "never asked"])
def test_a_video_sent_ahead_stops_decoding_once_its_request_has_ended(ending) -> None:
    """A video a decoder sent ahead (issue 63) is decoded for its request only: once that request's Encode
    is cancelled, or no Encode came within the claim time (a fake clock), the lane stops at the next
    frame and nothing reaches the tower."""
    clock = [0.0]
    cache = EmbeddingCache(TensorArena(1 << 16), clock=lambda: clock[0], sent_ahead_claim_s=10.0)
    lane, submitted, _ = _lane(cache)
    at_frame_5, go = _hold_at_frame_5(lane)
    finished = threading.Event()
    run = lane._run
    lane._run = lambda item: (run(item), finished.set())
    cache.acquire("k", want_lease=False, video=True, for_ask=True)  # the Prefetch with needed_now
    lane.start("k", _job(), DEMAND)
    assert at_frame_5.wait(WAIT_S)
    if ending == "ask cancelled":
        ask, _ = cache.acquire("k", want_lease=True, produce=False, video=True)  # the request's Encode
        ask.cancel()
    else:
        clock[0] = 10.0
    go.set()
    assert finished.wait(WAIT_S)
    assert lane.abandoned == 1 and not submitted
    assert lane.frames_decoded == 5, "decoding went on for a request that had ended"
    lane.shutdown()
