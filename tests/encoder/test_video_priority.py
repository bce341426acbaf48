"""Video decoding runs below images (issue 63): the video lane's threads, and the threads they start (a
video's decode parts, FFmpeg's codec threads), have a higher nice value than the threads that prepare
images, so that on busy cores another tenant's small image does not wait behind a long video. Read from
the OS's per-thread priority, not timed."""

from __future__ import annotations

import os
import threading

import pytest

from common.transport.arena import TensorArena
from encoder_svc.cache import EmbeddingCache
from encoder_svc.prep_threads import PrepThreads
from encoder_svc.video_lane import VideoLane

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities: Linux")
WAIT_S = 30.0


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class _Job:
    """Records the priority of the thread that decodes it, and of a thread that one starts."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.done = threading.Event()

    def decoded(self, keep_going=None, patch=True):
        self.seen["lane"] = _nice()
        helper = threading.Thread(target=lambda: self.seen.__setitem__("started", _nice()))
        helper.start()
        helper.join()
        self.done.set()
        return self


def test_video_decoding_runs_at_a_lower_priority_than_image_preparation():
    cache = EmbeddingCache(TensorArena(1 << 16))
    lane = VideoLane(cache, lambda key, job, priority: cache.fail(key, RuntimeError("not encoded here")),
                     threads=1)
    images = PrepThreads(1, "image-prep")
    try:
        fut, produce = cache.acquire("v", want_lease=False, video=True)
        assert produce
        job = _Job()
        lane.start("v", job, 0)
        assert job.done.wait(WAIT_S)
        image = images.submit(lambda _: _nice(), None).result(WAIT_S)
        assert job.seen["lane"] > image and job.seen["started"] > image, (job.seen, image)
    finally:
        lane.shutdown()
        images.shutdown()
