"""Which frames must be decoded to reach a video's sampled ones, known before any is decoded.

The packet index (the stream demuxed, nothing decoded: a few milliseconds for thousands of packets)
gives every frame's presentation timestamp and which packets are keyframes. Each sampled frame is then
reached either by decoding on from the previous sampled frame or by seeking to the keyframe at or
before it, whichever decodes fewer frames. So a long video of which four frames are sampled costs
about four groups of pictures, not every frame up to the last sampled one, and the cost (frames to
decode x their size) is known, and capped, before decoding starts (VideoLimits.check_decode_work).

A stream whose packets cannot be indexed (a packet without a timestamp, two with the same one) is
decoded in order from its first frame, and the schedule says so: its cost is every frame up to the
last sampled one.

What a request asked for bounds what it costs (`bounded_indices`, VideoLimits.max_decode_per_frame):
where reaching the sampled frames would decode more than k frames per frame kept (a long video of one
group of pictures), each sampled frame is moved to the nearest frame before it within that share.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from common.video.limits import VideoError
from common.video.probe import public_message


@dataclass(frozen=True)
class DecodeRun:
    """Frames first..last (presentation indices) decoded in one go, after a seek to `seek_pts`
    (None: on from where the previous run stopped, or from the stream's start)."""

    seek_pts: int | None
    first: int
    last: int

    @property
    def frames(self) -> int:
        """Frames this run decodes."""
        return self.last - self.first + 1


@dataclass(frozen=True)
class DecodeSchedule:
    """How a video's sampled frames are reached: runs of frames to decode, in order."""

    runs: tuple[DecodeRun, ...]
    frame_pts: tuple[int, ...] | None  # each frame's timestamp in presentation order; None: not indexed

    @property
    def frames_to_decode(self) -> int:
        """Every frame decoded to reach the sampled ones."""
        return sum(run.frames for run in self.runs)

    def split(self, parts: int) -> tuple[DecodeSchedule, ...]:
        """This schedule as up to `parts` schedules of consecutive runs, about equal in frames, each
        decodable on its own container: a part starts with a seek (or at the stream's start), never with a
        run that goes on from the previous one. One part (this schedule) when its frames are not indexed."""
        total = self.frames_to_decode
        if parts <= 1 or self.frame_pts is None or len(self.runs) < 2 or total < 1:
            return (self,)
        groups: list[list[DecodeRun]] = [[]]
        done = 0  # frames of the runs before this one
        for run in self.runs:
            due = min(parts - 1, done * parts // total)  # the part this run's first frame falls in
            if groups[-1] and run.seek_pts is not None and len(groups) <= due:
                groups.append([])
            groups[-1].append(run)
            done += run.frames
        return tuple(DecodeSchedule(tuple(g), self.frame_pts) for g in groups)

    @classmethod
    def in_order(cls, last: int) -> DecodeSchedule:
        """Decode from the first frame on, up to `last` (a stream without a usable packet index)."""
        return cls((DecodeRun(None, 0, last),), None)


@dataclass(frozen=True)
class PacketIndex:
    """A video stream's frames by presentation order: their timestamps and which are keyframes."""

    frame_pts: tuple[int, ...]  # sorted: frame i (presentation order) has frame_pts[i]
    keyframes: tuple[int, ...]  # presentation indices of the keyframes, increasing


def index_packets(container, stream) -> PacketIndex | None:
    """The stream's packet index from demuxing it (nothing decoded); None when its timestamps cannot
    number the frames. Consumes the container's packets: decode from another one."""
    pts: list[int] = []
    key_pts: list[int] = []
    try:
        for packet in container.demux(stream):
            # The demuxer's end-of-stream marker; packets an edit list cuts (decoded, never output).
            if packet.size == 0 or packet.is_discard:
                continue
            if packet.pts is None:
                return None
            pts.append(int(packet.pts))
            if packet.is_keyframe:
                key_pts.append(int(packet.pts))
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many types for bad streams
        raise VideoError(f"cannot read the video's packets: {public_message(exc)}") from None
    ordered = sorted(pts)
    if not ordered or len(set(ordered)) != len(ordered):
        return None
    position = {p: i for i, p in enumerate(ordered)}
    return PacketIndex(tuple(ordered), tuple(sorted(position[p] for p in key_pts)))


def bounded_indices(index: PacketIndex | None, indices: Sequence[int], per_frame: int) -> list[int]:
    """The sampled frames at `indices` (increasing), each moved to the nearest frame at or before it that
    costs at most `per_frame` frames to decode: from the keyframe at or before it, or on from the frame
    chosen before it (the only way without a packet index). Increasing still, and decoding them all
    costs at most per_frame x len(indices) frames."""
    keyframes = index.keyframes if index is not None else ()
    out: list[int] = []
    previous = -1  # the frame chosen before this one
    for wanted in (int(i) for i in indices):
        reach = previous + per_frame  # decoding on from the previous choice
        k = bisect.bisect_right(keyframes, wanted) - 1
        if k >= 0:  # seeking to the keyframe at or before it, then decoding on
            reach = max(reach, keyframes[k] + per_frame - 1)
        previous = min(wanted, reach)
        out.append(previous)
    return out


def schedule_decoding(index: PacketIndex | None, indices: Sequence[int]) -> DecodeSchedule:
    """The cheapest runs that reach every sampled frame at `indices` (increasing) with the index's
    keyframes; decoding in order when there is no index. VideoError when the stream has fewer frames
    than the last index needs."""
    last = int(indices[-1])
    if index is None:
        return DecodeSchedule.in_order(last)
    if last >= len(index.frame_pts):
        raise VideoError(f"the video stream ended after {len(index.frame_pts)} frames; frame {last} was "
                         "needed (from its packet index, before decoding)")
    runs: list[DecodeRun] = []
    at = -1  # the last frame decoded so far
    for wanted in (int(i) for i in indices):
        k = bisect.bisect_right(index.keyframes, wanted) - 1
        keyframe = index.keyframes[k] if k >= 0 else 0  # none before it: only the stream's start works
        on_cost = wanted - at  # frames decoded going on from `at`
        if runs and (keyframe <= at or on_cost <= wanted - keyframe + 1):
            runs[-1] = DecodeRun(runs[-1].seek_pts, runs[-1].first, wanted)
        elif not runs and keyframe == 0:
            runs.append(DecodeRun(None, 0, wanted))
        else:
            runs.append(DecodeRun(index.frame_pts[keyframe], keyframe, wanted))
        at = wanted
    return DecodeSchedule(tuple(runs), index.frame_pts)
