"""Small test videos made with PyAV itself: each frame one flat colour that changes with its index."""

from __future__ import annotations

import io

import av
import numpy as np


def frame_colour(i: int) -> tuple[int, int, int]:
    """The RGB colour of frame i (far apart from one frame to the next, so lossy codecs keep them apart)."""
    return (i * 40) % 256, (255 - i * 25) % 256, (i * 97 + 30) % 256


def make_video(num_frames: int = 20, fps: int = 10, codec: str = "mpeg4", fmt: str = "mp4",
               width: int = 64, height: int = 48, pix_fmt: str = "yuv420p", gop_size: int | None = None,
               still: bool = False) -> bytes:
    """Encoded bytes of a video of flat frames coloured frame_colour(i).

    gop_size: frames from one keyframe to the next (the encoder's default otherwise); still: every frame
    frame 0's colour, so the encoder adds no keyframe at a change of scene (one keyframe with a large
    gop_size: a video that can only be decoded from its start)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if gop_size is not None:
            stream.codec_context.gop_size = gop_size
        for i in range(num_frames):
            rgb = np.empty((height, width, 3), np.uint8)
            rgb[...] = frame_colour(0 if still else i)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def make_audio_only(fmt: str = "mp4") -> bytes:
    """An mp4 with one AAC audio stream and no video stream."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("aac", rate=16000)
        samples = np.zeros((1, 1024), np.float32)
        for _ in range(8):
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
