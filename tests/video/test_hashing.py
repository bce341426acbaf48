"""Content hashes: equal for the same input, different for other pixels, sampling or resize parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.hashing import is_content_hash
from common.video.config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO
from common.video.hashing import hash_video
from common.video.pipeline import read_video
from tests.video.media import make_video


@pytest.fixture(scope="module")
def data() -> bytes:
    return make_video(60, fps=10)  # 6 s


def test_same_input_same_hash(data) -> None:
    first = read_video(data, QWEN2_VL_VIDEO, "model").content_hash
    assert is_content_hash(first)
    assert read_video(bytes(data), QWEN2_VL_VIDEO, "model").content_hash == first


def test_other_sampling_other_hash(data) -> None:
    hashes = {
        read_video(data, QWEN2_VL_VIDEO, "model").content_hash,
        read_video(data, QWEN2_VL_VIDEO.with_request(fps=1.0), "model").content_hash,
        read_video(data, QWEN2_VL_VIDEO.with_request(max_frames=4), "model").content_hash,
        read_video(data, QWEN3_VL_VIDEO, "model").content_hash,
    }
    assert len(hashes) == 4


def test_parameters_count_even_for_the_same_frames(data) -> None:
    video = read_video(data, QWEN2_VL_VIDEO, "model").decoded
    frames, indices = video.frames, video.indices
    base = hash_video(frames, indices, QWEN2_VL_VIDEO, "model")
    # fps 2.0 and 2.0000001 sample the same 12 frames: still two entries, as the key says
    assert QWEN2_VL_VIDEO.with_request(fps=2.0000001).sampling.indices(60, 10.0).tolist() == indices.tolist()
    assert hash_video(frames, indices, QWEN2_VL_VIDEO.with_request(fps=2.0000001), "model") != base
    other_range = replace(QWEN2_VL_VIDEO, geometry=replace(QWEN2_VL_VIDEO.geometry, max_pixels=28 * 28 * 64))
    assert hash_video(frames, indices, other_range, "model") != base
    assert hash_video(frames, indices, QWEN2_VL_VIDEO, "other model") != base
    assert hash_video(frames, indices, QWEN2_VL_VIDEO, "model", cache_salt="tenant") != base
    shifted = [int(i) + 1 for i in indices]
    assert hash_video(frames, shifted, QWEN2_VL_VIDEO, "model") != base
    changed = frames.copy()
    changed[3, 0, 0, 0] ^= 1
    assert hash_video(changed, indices, QWEN2_VL_VIDEO, "model") != base
    with pytest.raises(ValueError, match="do not match"):
        hash_video(frames[:-1], indices, QWEN2_VL_VIDEO, "model")
