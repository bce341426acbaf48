"""The video lane: threads of their own that decode and patch videos before the tower sees them.

A video's decoding can take seconds (its frame count and size are capped from the header and packet
index, common/video), so it must not hold the threads that prepare images, nor the tower thread, which
waits for the prepared inputs of every job of its batch in turn. Videos are therefore decoded here, and
only a video whose frames are ready goes to the vision worker, which then merely stacks its patches.
Where the tower patches on its GPU (a Qwen encoder with the device-side processor), the lane hands over
the sampled uint8 frames instead: the host's patching (tens of milliseconds a clip, BENCHMARKS.md) leaves
the critical path, and a quarter of the fp32 rows' bytes crosses to the device.

Video decoding runs below images in the OS's scheduling (VIDEO_DECODE_NICENESS, on the lane's threads and
the decode and codec threads they start): on a host whose cores are all busy, another tenant's small image
is decoded and prepared first instead of waiting behind a long video's frames.

Decoding asks the cache between frames whether anyone still waits for the video (`still_wanted`): when
every caller has gone (its RPC cancelled, the decoder's own timeout), it stops at the next frame, and
the production is dropped so that a later request starts afresh. Memory the frames took is given back
to the system after each video (common/freed_memory.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from common.freed_memory import release_freed_memory
from common.video.decode import DecodeAbandoned
from encoder_svc.cache import EmbeddingCache
from encoder_svc.prep_threads import PrepThreads
from encoder_svc.videos import VideoJob
from encoder_svc.worker import DEMAND

log = logging.getLogger(__name__)

# Videos decoded at once; each uses up to --video-decode-threads threads of its own on top
# (common/video/decode.py), all stopped at their next frame by the same `keep_going`.
DEFAULT_VIDEO_THREADS = 2
# How far below the images' threads the lane's threads (and the decode threads they start) run: nice 10
# gets about a tenth of the CPU time of nice 0 when both want a core (Linux's CFS weights).
VIDEO_DECODE_NICENESS = 10


class VideoLane:
    """Decodes VideoJobs on `threads` threads, then hands them to `submit(key, job, priority)` (the
    vision worker's), or fails their key in `cache`; stops a job whose every caller has gone.
    patch_on_device: hand over the sampled frames unpatched (a tower that patches them on its GPU)."""

    def __init__(self, cache: EmbeddingCache, submit: Callable[[str, VideoJob, int], None],
                 threads: int = DEFAULT_VIDEO_THREADS, patch_on_device: bool = False) -> None:
        self.cache = cache
        self._submit = submit
        self.patch_on_device = patch_on_device
        self._threads = PrepThreads(threads, "video-decode", niceness=VIDEO_DECODE_NICENESS)
        self._lock = threading.Lock()
        self._stopping = False
        self.frames_decoded = 0  # every frame decoded, over all videos (the work done)
        self.abandoned = 0  # videos whose decoding stopped because every caller had gone
        self._in_lane: dict[str, bool] = {}  # key -> needed now (a demand caller joined it here)

    def start(self, key: str, job: VideoJob, priority: int) -> None:
        """Decode job for key (the cache's production of key) on the lane's threads."""
        with self._lock:
            self._in_lane[key] = False
        self._threads.submit(self._run, (key, job, priority))

    def boost(self, key: str) -> bool:
        """A demand caller joined key's production: if it is still here, it goes to the tower as demand
        work once decoded (True); False when it has left the lane (the worker's boost is the one)."""
        with self._lock:
            if key not in self._in_lane:
                return False
            self._in_lane[key] = True
            return True

    def _frame_decoded(self, key: str) -> bool:
        """Counts a decoded frame; whether to go on (not shutting down, and somebody still waits for key)."""
        with self._lock:
            self.frames_decoded += 1
        return not self._stopping and self.cache.still_wanted(key)

    def _run(self, item: tuple[str, VideoJob, int]) -> None:
        key, job, priority = item
        try:
            self._decode_and_submit(key, job, priority)
        finally:
            with self._lock:
                self._in_lane.pop(key, None)

    def _decode_and_submit(self, key: str, job: VideoJob, priority: int) -> None:
        try:
            if self._stopping or not self.cache.still_wanted(key):  # everyone left while it queued
                raise DecodeAbandoned
            ready = job.decoded(keep_going=lambda: self._frame_decoded(key), patch=not self.patch_on_device)
        except DecodeAbandoned:
            if self._stopping:  # the key stays pending: the cache's close fails it (shutting down)
                return
            with self._lock:
                self.abandoned += 1
            log.info("video %s: every caller has gone; decoding stopped", key[:16])
            return
        except Exception as exc:  # noqa: BLE001 - a bad video fails its own key, never the lane
            self.cache.fail(key, exc)
            return
        finally:
            release_freed_memory()
        with self._lock:  # raised meanwhile: demand work (the worker's lock is not taken under this one)
            needed_now = self._in_lane.pop(key, False)
        self._submit(key, ready, DEMAND if needed_now else priority)

    def shutdown(self) -> None:
        """Stop decoding at the next frame and let the threads exit; the videos' keys are left pending for
        the cache's close to fail (UNAVAILABLE: shutting down)."""
        self._stopping = True
        self._threads.shutdown()
