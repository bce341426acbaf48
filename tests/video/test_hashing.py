"""Content hashes from the container bytes: equal for the same input, different for other bytes, sampling,
resize parameters, model or salt; computed without decoding; the same as read_video's and plan_video's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO
from common.hashing import is_content_hash
from common.video import decode as decode_module
from common.video.hashing import hash_video_bytes
from common.video.pipeline import plan_video, read_video
from tests.video.media import make_video


@pytest.fixture(scope="module")
def data() -> bytes:
    return make_video(60, fps=10)  # 6 s


def test_same_input_same_hash_everywhere(data) -> None:
    first = hash_video_bytes(data, QWEN2_VL_VIDEO, "model")
    assert is_content_hash(first)
    assert hash_video_bytes(bytes(data), QWEN2_VL_VIDEO, "model") == first
    assert hash_video_bytes(memoryview(data), QWEN2_VL_VIDEO, "model") == first
    assert read_video(data, QWEN2_VL_VIDEO, "model").content_hash == first
    assert plan_video(data, QWEN2_VL_VIDEO, "model").content_hash == first


def test_every_parameter_counts(data) -> None:
    base = hash_video_bytes(data, QWEN2_VL_VIDEO, "model")
    other_range = replace(QWEN2_VL_VIDEO, geometry=replace(QWEN2_VL_VIDEO.geometry, max_pixels=28 * 28 * 64))
    others = [
        hash_video_bytes(data, QWEN2_VL_VIDEO.with_request(fps=1.0), "model"),
        # fps 2.0 and 2.0000001 sample the same frames: still two entries, as the key says
        hash_video_bytes(data, QWEN2_VL_VIDEO.with_request(fps=2.0000001), "model"),
        hash_video_bytes(data, QWEN2_VL_VIDEO.with_request(max_frames=4), "model"),
        hash_video_bytes(data, QWEN3_VL_VIDEO, "model"),
        hash_video_bytes(data, other_range, "model"),
        hash_video_bytes(data, QWEN2_VL_VIDEO, "other model"),
        hash_video_bytes(data, QWEN2_VL_VIDEO, "model", cache_salt="tenant"),
        hash_video_bytes(data[:-1] + bytes([data[-1] ^ 1]), QWEN2_VL_VIDEO, "model"),
    ]
    assert len({base, *others}) == len(others) + 1


def test_framing_keeps_fields_apart(data) -> None:
    # moving bytes between the salt and the model fingerprint must not give the same record
    one, other = (hash_video_bytes(data, QWEN2_VL_VIDEO, m, salt) for m, salt in (("ab", "c"), ("a", "bc")))
    assert one != other


@pytest.mark.parametrize("config", [QWEN2_VL_VIDEO, QWEN3_VL_VIDEO], ids=["qwen2.5", "qwen3"])
def test_plan_equals_read_video_without_decoding(data, config, monkeypatch) -> None:
    full = read_video(data, config, "model")

    def refuse(*args, **kwargs):
        raise AssertionError("plan_video decoded a frame")

    monkeypatch.setattr(decode_module, "decode_frames", refuse)
    plan = plan_video(data, config, "model")
    assert plan.indices == tuple(full.decoded.indices.tolist()) and plan.grid == full.grid
    assert plan.num_tokens == full.num_tokens and plan.content_hash == full.content_hash
    assert list(plan.timing.timestamps) == full.timestamps
    assert plan.timing.second_per_grid == full.second_per_grid
