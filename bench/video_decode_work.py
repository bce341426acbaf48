"""The work a long video costs when few of its frames are sampled: frames decoded and CPU seconds, with
the decode schedule (seeks to the keyframe before each sampled frame) and decoding in order as before.

    python -m bench.video_decode_work                          (3000 black 1080p H.264 frames, max_frames=4)
    python -m bench.video_decode_work --frames 18000 --keyint 100000   (the issue's bomb: one keyframe)

The video is made once with PyAV's libx264 (`--keyint`: frames between keyframes, x264's default 250)
and kept in /tmp. CPU seconds are the process's (FFmpeg's threads included).
"""

from __future__ import annotations

import argparse
import io
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--keyint", type=int, default=250)
    parser.add_argument("--max-frames", type=int, default=4)
    args = parser.parse_args()
    from common.video import decode as decode_module
    from common.video.config import QWEN2_VL_VIDEO
    from common.video.limits import VideoLimits
    from common.video.pipeline import plan_video
    from common.video.schedule import DecodeSchedule

    data = make_black_video(Path(f"/tmp/mmserve-bench-black-{args.frames}-k{args.keyint}.mp4"), args.frames,
                            args.keyint)
    limits = VideoLimits(max_decode_bytes=1 << 50)  # measure, do not refuse
    plan = plan_video(data, QWEN2_VL_VIDEO.with_request(max_frames=args.max_frames), "fp", limits=limits)
    indices = np.asarray(plan.indices)
    info, _, schedule = decode_module.plan_decoding(data, lambda _info: indices, limits)
    for name, chosen in (("scheduled", schedule), ("in order", DecodeSchedule.in_order(int(indices[-1])))):
        progress = decode_module._Progress(limits, None)
        started = time.process_time()
        decode_module._decode(data, limits, indices, info, chosen, progress)
        print(f"{name}: {progress.decoded} frames decoded for {len(indices)} sampled "
              f"({len(data)} bytes, {args.frames} frames, keyint {args.keyint}); "
              f"{time.process_time() - started:.2f} s CPU")
    print(f"default cap --max-video-decode-bytes: {VideoLimits().max_decode_bytes}; this schedule needs "
          f"{schedule.frames_to_decode * info.width * info.height * 3}")


if __name__ == "__main__":
    main()
