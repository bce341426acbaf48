"""Video grids and token counts against Hugging Face's get_num_of_video_patches, and the presets and
checkpoint files against HF's class defaults."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_qwen3_smart_resize

from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO, load_qwen_video_config
from common.families.qwen2_5_vl.video_geometry import qwen3_vl_smart_resize
from common.video.limits import VideoError
from tests.video.hf_source import qwen2_vl_class_defaults, qwen2_vl_function, qwen2_vl_processor_stand_in

FRAMES = [2, 3, 4, 7, 16, 33, 768]
SIZES = [(48, 64), (28, 28), (17, 300), (360, 640), (1080, 1920), (720, 1280), (2160, 3840), (1000, 30)]


def test_qwen2_grid_equals_hf() -> None:
    hf_patches = qwen2_vl_function("get_num_of_video_patches")
    d = qwen2_vl_class_defaults()
    for pixels in [(d["size"]["shortest_edge"], d["size"]["longest_edge"]), (3136, 12845056)]:
        geometry = replace(QWEN2_VL_VIDEO.geometry, min_pixels=pixels[0], max_pixels=pixels[1])
        hf = qwen2_vl_processor_stand_in({"shortest_edge": pixels[0], "longest_edge": pixels[1]})
        for n, (h, w) in itertools.product(FRAMES, SIZES):
            grid = geometry.grid(n, h, w)
            assert grid[0] * grid[1] * grid[2] == hf_patches(hf, n, h, w, {}), (pixels, n, h, w)
            assert geometry.num_tokens(grid) * 4 == grid[0] * grid[1] * grid[2]


@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_grid_equals_hf(cap: bool) -> None:
    hf = Qwen3VLVideoProcessor()
    geometry = replace(QWEN3_VL_VIDEO.geometry, cap_pixels_per_frame=cap)
    for n, (h, w) in itertools.product(FRAMES, SIZES):
        grid = geometry.grid(n, h, w)
        patches = hf.get_num_of_video_patches(n, h, w, {"cap_pixels_per_frame": cap})
        assert grid[0] * grid[1] * grid[2] == patches, (cap, n, h, w)
        assert geometry.num_tokens(grid) == patches // 4
        assert geometry.tokens_per_group(grid) * grid[0] == geometry.num_tokens(grid)


def test_qwen3_smart_resize_equals_hf() -> None:
    for n, (h, w) in itertools.product(FRAMES, SIZES + [(10, 20), (31, 100)]):
        assert qwen3_vl_smart_resize(n, h, w, 2, 32, 128 * 32 * 32, 32 * 32 * 768) == hf_qwen3_smart_resize(
            n, h, w, temporal_factor=2, factor=32, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768)


def test_hand_computed_grids() -> None:
    # Qwen2: 6 frames of 64x48, per-frame range [100352, 602112], factor 28: 56x56 < min, so
    # beta = sqrt(100352 / 3072); h = ceil(48 * beta / 28) * 28 = 280, w = 392 -> grid (3, 20, 28), 420 tokens
    assert QWEN2_VL_VIDEO.geometry.grid(6, 48, 64) == (3, 20, 28)
    assert QWEN2_VL_VIDEO.geometry.num_tokens((3, 20, 28)) == 420
    # Qwen3: the range bounds all 6 frames: 6 * 64 * 64 < 131072, beta = sqrt(131072 / (6 * 3072)),
    # h = ceil(48 * beta / 32) * 32 = 128, w = 192 -> (3, 8, 12), 72 tokens, 24 per timestamp
    assert QWEN3_VL_VIDEO.geometry.grid(6, 48, 64) == (3, 8, 12)
    assert QWEN3_VL_VIDEO.geometry.tokens_per_group((3, 8, 12)) == 24
    # 5 frames: the last repeats, t = 3
    assert QWEN3_VL_VIDEO.geometry.grid(5, 48, 64)[0] == 3
    # Qwen2 with cap_pixels_per_frame (Qwen2VLVideoProcessor.resize): 768 frames of 1080x1920;
    # budget int(128000 * 784 * 0.9) * 2 // 768 = 235200 < 602112, above 1.05 * 100352
    capped = replace(QWEN2_VL_VIDEO.geometry, cap_pixels_per_frame=True)
    h, w = capped.resized_size(768, 1080, 1920)
    assert h * w <= 235200 and (h, w) != QWEN2_VL_VIDEO.geometry.resized_size(768, 1080, 1920)


def test_geometry_errors_are_video_errors() -> None:
    with pytest.raises(VideoError, match="aspect ratio"):
        QWEN2_VL_VIDEO.geometry.grid(4, 10, 2100)
    with pytest.raises(VideoError, match="aspect ratio"):
        QWEN3_VL_VIDEO.geometry.grid(4, 40, 8100)
    with pytest.raises(VideoError, match="fewer than the temporal patch"):
        QWEN3_VL_VIDEO.geometry.grid(1, 48, 64)


def test_presets_are_hfs_class_defaults() -> None:
    d = qwen2_vl_class_defaults()
    g, s = QWEN2_VL_VIDEO.geometry, QWEN2_VL_VIDEO.sampling
    assert (g.min_pixels, g.max_pixels) == (d["size"]["shortest_edge"], d["size"]["longest_edge"])
    assert (g.patch_size, g.merge_size, g.temporal_patch_size, g.max_video_tokens) == (
        d["patch_size"], d["merge_size"], d["temporal_patch_size"], d["max_video_tokens"])
    assert (s.min_frames, s.max_frames) == (d["min_frames"], d["max_frames"])
    assert list(QWEN2_VL_VIDEO.image_mean) == list(d["image_mean"])
    assert list(QWEN2_VL_VIDEO.image_std) == list(d["image_std"])
    hf = Qwen3VLVideoProcessor()
    g = QWEN3_VL_VIDEO.geometry
    assert (g.min_pixels, g.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert (g.patch_size, g.merge_size, g.temporal_patch_size, g.max_video_tokens) == (
        hf.patch_size, hf.merge_size, hf.temporal_patch_size, hf.max_video_tokens)
    assert list(QWEN3_VL_VIDEO.image_mean) == list(hf.image_mean)
    assert list(QWEN3_VL_VIDEO.image_std) == list(hf.image_std)


def test_load_config_follows_hfs_file_order(tmp_path) -> None:
    qwen25 = tmp_path / "q25"
    qwen25.mkdir()
    (qwen25 / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    # a Qwen2.5-VL checkpoint's only processor file: HF's video processor takes its min/max pixels
    (qwen25 / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2}))
    cfg = load_qwen_video_config(qwen25)
    assert (cfg.geometry.min_pixels, cfg.geometry.max_pixels) == (3136, 12845056)
    assert cfg.sampling.method == "qwen2_vl" and cfg.sampling.fps == 2.0

    qwen3 = tmp_path / "q3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    image_size = {"size": {"shortest_edge": 1, "longest_edge": 2}}  # the image processor's: not used
    (qwen3 / "preprocessor_config.json").write_text(json.dumps(image_size))
    (qwen3 / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 4, "max_frames": 64}))
    cfg = load_qwen_video_config(qwen3)
    assert (cfg.geometry.min_pixels, cfg.geometry.max_pixels) == (4096, 25165824)
    assert (cfg.sampling.fps, cfg.sampling.max_frames, cfg.geometry.patch_size) == (4.0, 64, 16)
    (qwen3 / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 1}}))
    assert load_qwen_video_config(qwen3).sampling.fps == 1.0


def test_a_requests_min_pixels_below_the_models_is_taken() -> None:
    """As HF's Qwen2-VL video processor takes size["shortest_edge"] from the caller: a small clip keeps
    its grid with a lower min_pixels instead of being scaled up to the model's (vLLM passes it on)."""
    from common.video.request import video_request_config

    hf_patches = qwen2_vl_function("get_num_of_video_patches")
    low = 28 * 28 * 4
    config = video_request_config(QWEN2_VL_VIDEO, min_pixels=low)
    assert config.geometry.min_pixels == low
    high = QWEN2_VL_VIDEO.geometry.max_pixels
    hf = qwen2_vl_processor_stand_in({"shortest_edge": low, "longest_edge": high})
    grid = config.geometry.grid(4, 56, 84)
    assert grid[0] * grid[1] * grid[2] == hf_patches(hf, 4, 56, 84, {})
    assert grid != QWEN2_VL_VIDEO.geometry.grid(4, 56, 84)  # the model's min_pixels scales it up
    floor = video_request_config(QWEN2_VL_VIDEO, min_pixels=1).geometry.min_pixels
    assert floor == 28 * 28  # one merged block at least
