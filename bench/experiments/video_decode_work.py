"""The work a long video costs when few of its frames are sampled: frames decoded and CPU seconds, with
the decode schedule (seeks to the keyframe before each sampled frame) and decoding in order as before.

    python -m bench.experiments.video_decode_work         (3000 black 1080p H.264 frames, max_frames=4)
    python -m bench.experiments.video_decode_work --frames 18000 --keyint 100000
                                                          (the issue's bomb: one keyframe)
    python -m bench.experiments.video_decode_work --frames 6000 --keyint 100000 --max-frames 2
                                                          (issue 63's one-GOP clip: the per-frame bound)
    python -m bench.experiments.video_decode_work --clip [--threads N]
                                                          (host time of one served clip, split by part)

The video is made once with PyAV's libx264 (`--keyint`: frames between keyframes, x264's default 250)
and kept in /tmp. CPU seconds are the process's (FFmpeg's threads included).

--clip: the encoder's host work on the clip bench.video_serve sends (--clip-seconds 30, --clip-fps 30,
--clip-size 448, mpeg4, Qwen2.5-VL's 2 fps: 60 of 900 frames), split into planning (demux, packet index,
schedule), decoding the scheduled frames, converting the sampled ones to RGB and patching (resize,
normalise, patchify), one thread against --threads (default: --video-decode-threads' default) side by
side, with the frames-first normalisation (the old order) against video_patches' rows-first one; medians
of --repeats, and whether the frames and rows are the same.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np


def make_black_video(path: Path, frames: int, keyint: int) -> bytes:
    """A 1920x1080 H.264 MP4 of black frames at 30 fps, made once."""
    if not path.exists():
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=30, options={"preset": "ultrafast",
                                                                       "x264-params": f"keyint={keyint}"})
            stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
            black = av.VideoFrame.from_ndarray(np.zeros((1080, 1920, 3), np.uint8), format="rgb24")
            for i in range(frames):
                black.pts = i
                for packet in stream.encode(black):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        path.write_bytes(buf.getvalue())
    return path.read_bytes()


def _median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """(median wall milliseconds of `repeats` calls, the last call's result)."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 1), result


def _decode_unconverted(data: bytes, limits, schedule) -> int:
    """The schedule's frames decoded on one thread, none converted to RGB: the decoding alone."""
    from common.video.probe import open_video

    position = {p: i for i, p in enumerate(schedule.frame_pts)}
    decoded = 0
    with open_video(data, limits) as (container, stream, _):
        for run in schedule.runs:
            if run.seek_pts is not None:
                container.seek(run.seek_pts, stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                decoded += 1
                if position[frame.pts] >= run.last:
                    break
    return decoded


def _frames_first_patches(frames: np.ndarray, config):
    """Patch rows as video_patches made them before: the frames normalised in float32, then patchified."""
    import torch

    from common.video.patches import normalize_frames, patchify, resize_frames

    x = torch.as_tensor(frames).permute(0, 3, 1, 2).contiguous()
    g = config.geometry
    grid = g.grid(*x.shape[:1], *x.shape[2:])
    x = resize_frames(x, (grid[1] * g.patch_size, grid[2] * g.patch_size))
    x = normalize_frames(x, config.image_mean, config.image_std, config.rescale_factor)
    return patchify(x, g.patch_size, g.merge_size, g.temporal_patch_size)


def clip_split(args: argparse.Namespace) -> dict:
    """The --clip section: each part's median milliseconds, one thread against args.threads."""
    import torch

    from bench.video_serve import make_clip
    from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO
    from common.video import decode as decode_module
    from common.video.limits import VideoLimits, available_cores
    from common.video.patches import video_patches

    path = Path(f"/tmp/mmserve-bench-clip-mpeg4-{args.clip_seconds:g}s-{args.clip_fps}-{args.clip_size}.mp4")
    if not path.exists():
        path.write_bytes(make_clip(args.clip_seconds, args.clip_fps, args.clip_size, 0, "mpeg4"))
    data, config = path.read_bytes(), QWEN2_VL_VIDEO
    one, many = VideoLimits(decode_threads=1), VideoLimits(decode_threads=args.threads)
    sample = config.sampling.indices_for
    plan_ms, (info, indices, schedule) = _median_ms(lambda: decode_module.plan_decoding(data, sample, one),
                                                    args.repeats)
    decode_ms, _ = _median_ms(lambda: _decode_unconverted(data, one, schedule), args.repeats)
    rows = {"clip": f"{len(data)} bytes, {info.total_frames} frames {info.width}x{info.height} "
                    f"{info.codec}, {len(indices)} sampled, {schedule.frames_to_decode} to decode in "
                    f"{len(schedule.runs)} runs; {available_cores()} cores, torch "
                    f"{torch.get_num_threads()} threads",
            "plan (demux, packet index, schedule)": plan_ms,
            "decode the scheduled frames, none converted (1 thread)": decode_ms}
    results = {}
    for label, limits in (("1 thread", one), (f"{many.decode_thread_count} threads", many)):
        ms, video = _median_ms(lambda limits=limits: decode_module.decode_video(data, sample, limits),
                               args.repeats)
        results[label] = video
        rows[f"decode_video, sampled frames converted ({label})"] = ms
    videos = list(results.values())
    rows["frames equal"] = bool(np.array_equal(videos[0].frames, videos[1].frames))
    frames = videos[0].frames
    old_ms, old_rows = _median_ms(lambda: _frames_first_patches(frames, config), args.repeats)
    new_ms, (new_rows, _) = _median_ms(lambda: video_patches(frames, config), args.repeats)
    rows["patches, frames normalised then patchified (before)"] = old_ms
    rows["patches, video_patches: patchified uint8, rows normalised (after)"] = new_ms
    rows["rows equal"] = bool(torch.equal(old_rows, new_rows))
    decode_rows = [k for k in rows if k.startswith("decode_video")]
    rows["host total before (1 thread, frames-first)"] = round(rows[decode_rows[0]] + old_ms, 1)
    rows["host total after"] = round(rows[decode_rows[1]] + new_ms, 1)
    return rows


def main() -> None:
    from common.video.limits import VideoLimits, default_decode_threads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--keyint", type=int, default=250)
    parser.add_argument("--max-frames", type=int, default=4)
    parser.add_argument("--per-frame", type=int, default=VideoLimits().max_decode_per_frame,
                        help="--max-video-decode-per-frame for the bounded schedule")
    parser.add_argument("--clip", action="store_true", help="the served clip's host time, split by part")
    parser.add_argument("--clip-seconds", type=float, default=30.0)
    parser.add_argument("--clip-fps", type=int, default=30)
    parser.add_argument("--clip-size", type=int, default=448)
    parser.add_argument("--threads", type=int, default=default_decode_threads(),
                        help="decode threads against one (--clip)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per part; medians (--clip)")
    args = parser.parse_args()
    if args.clip:
        for name, value in clip_split(args).items():
            print(f"{name}: {value}")
        return
    from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO
    from common.video import decode as decode_module
    from common.video.pipeline import plan_video
    from common.video.schedule import DecodeSchedule

    data = make_black_video(Path(f"/tmp/mmserve-bench-black-{args.frames}-k{args.keyint}.mp4"), args.frames,
                            args.keyint)
    config = QWEN2_VL_VIDEO.with_request(max_frames=args.max_frames)
    for label, per_frame in (("bounded", args.per_frame), ("unbounded", 0)):
        # measure, do not refuse: no byte cap; the per-frame bound (--max-video-decode-per-frame) or none
        limits = VideoLimits(max_decode_bytes=1 << 50, max_decode_per_frame=per_frame)
        plan = plan_video(data, config, "fp", limits=limits)
        indices = np.asarray(plan.indices)
        info, _, schedule = decode_module.plan_decoding(data, lambda _info, i=indices: i, limits)
        chosen = [(f"scheduled, {label} ({per_frame or 'no'} frames per frame kept)", schedule)]
        if label == "unbounded":
            chosen.append(("in order", DecodeSchedule.in_order(int(indices[-1]))))
        for name, runs in chosen:
            progress = decode_module._Progress(limits, None)
            started = time.process_time()
            decode_module._decode(data, limits, indices, info, runs, progress)
            print(f"{name}: {progress.decoded} frames decoded for {len(indices)} sampled, frames "
                  f"{indices.tolist()} at {[round(t, 2) for t in plan.timing.timestamps]} s "
                  f"({len(data)} bytes, {args.frames} frames, keyint {args.keyint}); "
                  f"{time.process_time() - started:.2f} s CPU")
    print(f"default cap --max-video-decode-bytes: {VideoLimits().max_decode_bytes}; the unbounded schedule "
          f"needs {schedule.frames_to_decode * info.width * info.height * 3}")


if __name__ == "__main__":
    main()
