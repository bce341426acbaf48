"""Sampled frames to a Qwen vision tower's patch rows, laid out as Hugging Face's video processors do.

The steps are those of `Qwen2VLVideoProcessor._preprocess` / `Qwen3VLVideoProcessor._preprocess` (the
torchvision backend; torchvision itself is not needed): every frame resized to the grid's size with
bicubic antialiased interpolation, then HF's fused rescale-and-normalise in float32, then `patchify`: the
frames padded to a multiple of the temporal patch size with the last one, grouped by it along time, and
each group's patches in the order the tower expects (each merge block's patches contiguous; within a
row: channel, then time, then the patch's pixels), the same flattening as the image path
(common/families/qwen2_5_vl/pixels.py), where an image is one frame repeated.

`video_patches` patchifies the uint8 frames and normalises the rows after (`normalize_rows`, in place):
patchify only moves values, and each value is normalised by the same float32 operations with its
channel's mean and std, so the rows are HF's to the bit, for a quarter of the bytes moved by the
patchify and no float32 temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from common.image_geometry import Grid
from common.video.rules import VideoConfig


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [n, C, H, W] frames resized to size (h, w) as torchvision's v2 `resize` (BICUBIC, antialias),
    which HF's video processors call: unchanged at the same size; on CPU torch's native uint8 kernel (it
    rounds between its two passes), elsewhere float32 interpolation, clamped and rounded back to uint8."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=list(size), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def normalize_frames(frames: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                     rescale_factor: float = 1 / 255) -> torch.Tensor:
    """float32 (x - mean) / std of uint8 [n, C, H, W] frames, with HF's fused rescale: mean and std are
    scaled by 1 / rescale_factor in float32 and the frames are not divided by 255 (the same rounding as
    TorchvisionBackend.rescale_and_normalize)."""
    m, s = _fused_mean_std(mean, std, rescale_factor, frames.device)
    return (frames.to(torch.float32) - m.view(-1, 1, 1)) / s.view(-1, 1, 1)


def _fused_mean_std(mean: Sequence[float], std: Sequence[float], rescale_factor: float,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 mean and std per channel, scaled by 1 / rescale_factor (HF's fused rescale)."""
    m = torch.tensor(list(mean), device=device) * (1.0 / rescale_factor)
    s = torch.tensor(list(std), device=device) * (1.0 / rescale_factor)
    return m, s


def normalize_rows(rows: torch.Tensor, channels: int, mean: Sequence[float], std: Sequence[float],
                   rescale_factor: float = 1 / 255) -> torch.Tensor:
    """float32 patch rows [N, C*...] of uint8 ones, each value normalised as `normalize_frames` does its
    channel's (each row holds its channels' values one after another): the same values, bit for bit, in
    one float32 tensor normalised in place."""
    m, s = _fused_mean_std(mean, std, rescale_factor, rows.device)
    out = rows.to(torch.float32)
    per_channel = out.view(out.shape[0], channels, -1)
    per_channel.sub_(m.view(1, -1, 1)).div_(s.view(1, -1, 1))
    return out


def patchify(frames: torch.Tensor, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> torch.Tensor:
    """[n, C, H, W] frames (H, W multiples of patch x merge) to rows [t*h*w, C*temporal*patch*patch]."""
    if pad := -frames.shape[0] % temporal_patch_size:  # the last frame repeats to fill the last group
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
    n, c, height, width = frames.shape
    p, m, tp = patch_size, merge_size, temporal_patch_size
    t, gh, gw = n // tp, height // p, width // p
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * tp * p * p)


def video_patches(frames: np.ndarray | torch.Tensor, config: VideoConfig,
                  device: str | torch.device = "cpu") -> tuple[torch.Tensor, Grid]:
    """Patch rows (float32) and (t, h, w) grid of uint8 [n, H, W, 3] RGB sampled frames: resized (when
    the grid's size differs), patchified as uint8, then normalised (see the module's docstring)."""
    n, height, width, _ = frames.shape
    grid = config.geometry.grid(n, height, width)
    return frames_to_rows(frames, grid, config, device), grid


# A resize converts frames to float32 on a GPU (resize_frames): at most this many bytes of them at a time, so
# that a long high-resolution video (up to --max-video-decoded-bytes of uint8 frames) needs no more on the
# device than its uint8 frames and a bounded working set.
RESIZE_CHUNK_BYTES = 256 << 20


def frames_to_rows(frames: np.ndarray | torch.Tensor, grid: Grid, config: VideoConfig,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """Patch rows (float32, on device) of uint8 [n, H, W, 3] RGB frames whose (t, h, w) grid is known:
    `video_patches` without working the grid out again. On a GPU the uint8 frames cross to the device
    (a quarter of the rows' bytes) and everything after runs there: the same rows as on the host when no
    resize is needed (the same float32 operations), within a pixel level otherwise (resize_frames)."""
    g = config.geometry
    size = (grid[1] * g.patch_size, grid[2] * g.patch_size)
    x = resized_frames(torch.as_tensor(frames), size, torch.device(device))
    rows = patchify(x, g.patch_size, g.merge_size, g.temporal_patch_size)
    return normalize_rows(rows, x.shape[1], config.image_mean, config.image_std, config.rescale_factor)


def resized_frames(frames: torch.Tensor, size: tuple[int, int], device: torch.device,
                   chunk_bytes: int = RESIZE_CHUNK_BYTES) -> torch.Tensor:
    """uint8 [n, H, W, C] frames as uint8 [n, C, h, w] at size on device (a view when no resize is
    needed): resized a few frames at a time, each chunk's float32 copy under chunk_bytes (each frame is
    resized on its own, so chunks give the same pixels as one call)."""
    n, height, width, channels = frames.shape
    if (height, width) == tuple(size):
        return frames.to(device).permute(0, 3, 1, 2)  # a view: patchify's reshape copies once
    out = torch.empty((n, channels, *size), dtype=torch.uint8, device=device)
    step = max(1, chunk_bytes // (height * width * channels * 4))
    for i in range(0, n, step):
        chunk = frames[i:i + step].to(device).permute(0, 3, 1, 2).contiguous()
        out[i:i + step] = resize_frames(chunk, size)
    return out
