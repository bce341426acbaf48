"""Where an Encode's time goes: its wall time split into stages that add up to it.

    receive      argument checks, before any input is read
    decode       decoding and hashing the image files (a video: its header checks and hash)
    queue        waiting for a preprocessing thread and for the tower (behind other batches)
    preprocess   the image processor (resize, normalise, patch; on a GPU: the host side of it); a video's
                 frame decoding and patching on the video lane, before the worker gets it
    tower        the vision tower over the batch holding the image, until its rows are in the cache
                 (on a GPU: launched, with the producer event recorded; the device's own time per
                 batch is `tower_gpu_seconds`)
    handoff      the reply: back to the event loop, leases and refs, inline copies

The worker stamps each job it runs (`JobTimes`); an Encode that waited for jobs takes the one that
finished last (the one that set its wait), clipped to the time it waited: a request that joined an
encode already running counts only what it waited for. A cache hit has no queue, preprocess or tower.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STAGES = ("receive", "decode", "queue", "preprocess", "tower", "handoff")

# Where the tower thread's own time goes (VisionWorker), summed over its batches: waiting for work
# (`idle`), for the batch's preparations (`prepare_wait`), launching the tower (`launch`: on a GPU the
# host's side of it, which blocks once the device's queue is full), storing the rows in the cache
# (`store`), and the fence on batches in flight (`fence`). Beside tower_gpu_seconds it says whether
# the device waits for the host (idle or prepare_wait large while the GPU is not busy) or the host for
# the device (launch or fence large).
TOWER_THREAD_PHASES = ("idle", "prepare_wait", "launch", "store", "fence")


@dataclass
class JobTimes:
    """Monotonic stamps (time.perf_counter) of one job in the vision worker; 0.0 until reached."""

    submitted: float = 0.0
    prep_start: float = 0.0
    prep_end: float = 0.0
    tower_start: float = 0.0
    tower_end: float = 0.0


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def split_encode(started: float, checked: float, decoded: float, waiting: float, ended: float,
                 jobs: Iterable[JobTimes | None]) -> dict[str, float]:
    """Seconds per stage of one Encode, from its stamps: `started` (the RPC began), `checked` (arguments
    checked), `decoded` (inputs decoded), `waiting` (inputs admitted to the cache and the worker; the wait
    for embeddings began), `ended` (the reply built); and the worker's stamps of the jobs it waited for
    (None: a hit, or no stamps). The stages add up to ended - started; admission counts as queue."""
    split = dict.fromkeys(STAGES, 0.0)
    split["receive"] = max(0.0, checked - started)
    split["decode"] = max(0.0, decoded - checked)
    split["queue"] = max(0.0, waiting - decoded)
    finished = [j for j in jobs if j is not None and j.tower_end > waiting]
    if finished:
        last = max(finished, key=lambda j: j.tower_end)
        lane = _overlap(waiting, last.submitted, waiting, last.tower_end)  # a video, before the worker
        split["preprocess"] = lane + _overlap(last.prep_start, last.prep_end, waiting, last.tower_end)
        split["tower"] = _overlap(last.tower_start, last.tower_end, waiting, last.tower_end)
        split["queue"] += max(0.0, last.tower_end - waiting - split["preprocess"] - split["tower"])
    split["handoff"] = max(0.0, (ended - started) - sum(split.values()))
    return split
