"""Patch rows: shape, HF's own patchify and fused normalisation, and a direct numpy computation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from common.families.qwen2_5_vl.video_config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO
from common.video.patches import normalize_frames, patchify, resize_frames, video_patches
from tests.video.hf_source import qwen2_vl_function

# Qwen2 at 56x56 per frame stays 56x56 (no resampling): its rows can be computed by hand
NO_RESIZE = replace(QWEN2_VL_VIDEO, geometry=replace(QWEN2_VL_VIDEO.geometry, min_pixels=56 * 56))


def _frames(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def _numpy_rows(frames: np.ndarray, mean, std, p: int = 14, m: int = 2, tp: int = 2) -> np.ndarray:
    """The rows written out: for each temporal group, merge block, then patch in the block; a row is
    channel-major, then time, then the patch's pixels."""
    x = (frames.astype(np.float64) / 255 - np.asarray(mean)) / np.asarray(std)  # [n, H, W, C]
    if len(x) % tp:
        x = np.concatenate([x, np.repeat(x[-1:], tp - len(x) % tp, axis=0)])
    n, height, width, c = x.shape
    rows = []
    for t in range(n // tp):
        for bh in range(height // p // m):
            for bw in range(width // p // m):
                for ih in range(m):
                    for iw in range(m):
                        y, z = (bh * m + ih) * p, (bw * m + iw) * p
                        block = x[t * tp:(t + 1) * tp, y:y + p, z:z + p, :]  # [tp, p, p, C]
                        rows.append(block.transpose(3, 0, 1, 2).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rows_equal_numpy_for_frame_pairs(n: int) -> None:
    frames = _frames(n, 56, 56)
    rows, grid = video_patches(frames, NO_RESIZE)
    assert grid == (-(-n // 2), 4, 4)
    assert rows.shape == (grid[0] * 16, 3 * 2 * 14 * 14) and rows.dtype == torch.float32
    expected = _numpy_rows(frames, NO_RESIZE.image_mean, NO_RESIZE.image_std)
    np.testing.assert_allclose(rows.numpy(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("n", [5, 6])
def test_patchify_equals_hfs(n: int) -> None:
    x = torch.from_numpy(_frames(n, 64, 96, seed=n)).permute(0, 3, 1, 2).float()
    hf3, t, h, w = Qwen3VLVideoProcessor.patchify(None, x[None], patch_size=16, merge_size=2,
                                                  temporal_patch_size=2)
    assert torch.equal(patchify(x, 16, 2, 2), hf3[0]) and (t, h, w) == (3, 4, 6)
    x = x[:, :, :56, :84]
    hf2, *_ = qwen2_vl_function("patchify")(None, x[None].contiguous(), patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    assert torch.equal(patchify(x.contiguous(), 14, 2, 2), hf2[0])


def test_normalisation_equals_hfs_fused_rescale() -> None:
    frames = torch.from_numpy(_frames(2, 8, 8)).permute(0, 3, 1, 2).contiguous()
    for config in (QWEN2_VL_VIDEO, QWEN3_VL_VIDEO):
        hf = Qwen3VLVideoProcessor()
        mean, std, _ = hf._fuse_mean_std_and_rescale_factor(
            do_normalize=True, image_mean=tuple(config.image_mean), image_std=tuple(config.image_std),
            do_rescale=True, rescale_factor=1 / 255, device=frames.device)
        # tvF.normalize is (x - mean) / std per channel
        expected = (frames.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        assert torch.equal(normalize_frames(frames, config.image_mean, config.image_std), expected)


def test_resize_keeps_flat_colours_and_takes_the_grid_size() -> None:
    frames = np.empty((3, 48, 64, 3), np.uint8)
    frames[...] = (200, 17, 90)
    rows, grid = video_patches(frames, QWEN3_VL_VIDEO)
    assert grid == (2, 12, 16) and rows.shape == (2 * 12 * 16, 3 * 2 * 16 * 16)  # 3 frames: t = 2
    values = rows.reshape(-1, 3, 2 * 16 * 16)  # per channel, one value each
    expected = (np.array([200, 17, 90]) / 255 - 0.5) / 0.5
    np.testing.assert_allclose(values.amin(dim=(0, 2)).numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(values.amax(dim=(0, 2)).numpy(), expected, atol=1e-6)


def test_resize_is_a_no_op_at_the_same_size_and_smooth_otherwise() -> None:
    x = torch.from_numpy(_frames(2, 28, 28)).permute(0, 3, 1, 2).contiguous()
    assert resize_frames(x, (28, 28)) is x
    ramp = torch.arange(64, dtype=torch.uint8).mul(4).expand(1, 3, 48, 64).contiguous()
    out = resize_frames(ramp, (96, 128))
    assert out.dtype == torch.uint8 and out.shape == (1, 3, 96, 128)
    assert torch.all(out[0, 0, 0, 1:].int() >= out[0, 0, 0, :-1].int())  # a ramp stays a ramp
