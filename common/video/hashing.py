"""Content hash of a sampled video: the key its embeddings are cached under.

It is common.hashing's framed image record over the sampled frames' decoded pixels (all frames, in
order, at their decoded size), made under a fingerprint that also names the sampling and resize
parameters and the sampled indices (qwen_layout.hash_fingerprint's idea): the same file at another fps
or max_frames, or resized into another pixel range, is another cache entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.hashing import image_content_hash
from common.video.config import QwenVideoConfig


def video_fingerprint(model_fingerprint: str, config: QwenVideoConfig, indices: Sequence[int]) -> str:
    """The fingerprint a video's hash is made under: model, every processing parameter, sampled indices."""
    frames = ",".join(str(int(i)) for i in indices)
    return f"{model_fingerprint}|video|{config.key()}|indices={frames}"


def hash_video(frames: np.ndarray, indices: Sequence[int], config: QwenVideoConfig, model_fingerprint: str,
               cache_salt: str = "") -> str:
    """Hex content hash of uint8 [n, H, W, 3] RGB frames sampled at indices under config."""
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.shape[0] != len(indices):
        raise ValueError(f"frames {frames.shape} do not match {len(indices)} sampled RGB frames")
    n, height, width, _ = frames.shape
    # The mode tag keeps a video's record apart from any image's (whose mode is a Pillow mode).
    return image_content_hash(video_fingerprint(model_fingerprint, config, indices), cache_salt,
                              f"video:rgb24x{n}", width, height, frames.tobytes()).hex()
