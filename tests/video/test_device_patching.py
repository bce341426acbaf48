"""A video patched on the tower's device: where an encoder's images are preprocessed there (preprocess
"torch"), the video lane hands the worker the sampled uint8 frames and the tower patches them itself.
The rows, and so the embeddings, are those of the host's patching: exactly, on the CPU's uint8 resize
(a GPU's float resize is within a pixel level: tests/gpu)."""

from __future__ import annotations

import threading

import pytest
import torch

from common.families.qwen2_5_vl.encoder import QwenVisionEncoder
from common.families.qwen2_5_vl.video_config import load_qwen_video_config
from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
from common.transport.arena import TensorArena
from common.video import plan_video, video_request_config
from common.video.limits import VideoLimits
from common.video.patches import frames_to_rows, resize_frames, resized_frames, video_patches
from encoder_svc.cache import EmbeddingCache
from encoder_svc.video_lane import VideoLane
from encoder_svc.videos import VideoJob
from tests.video.media import make_video

LIMITS = VideoLimits(max_per_request=3)
# 240x180 is resized to the 28-px grid (252x168 for Qwen2.5-VL); 224x224 is on it already
CLIPS = {"resized": make_video(25, fps=10, width=240, height=180),
         "on_grid": make_video(25, fps=10, width=224, height=224)}


def _job(model_dir, data: bytes) -> VideoJob:
    config = video_request_config(load_qwen_video_config(model_dir), limits=LIMITS)
    return VideoJob(data, config, LIMITS, plan_video(data, config, "fp", "", LIMITS))


@pytest.fixture(scope="module", params=["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def encoders(request):
    """(host-patching encoder, device-patching encoder, model dir) of one preset, on the CPU."""
    if request.param == "qwen2.5-vl-tiny":
        model_dir, cls = request.getfixturevalue("qwen_model_dir"), QwenVisionEncoder
    else:
        model_dir, cls = request.getfixturevalue("qwen3_model_dir"), Qwen3VisionEncoder
    return cls(model_dir, preprocess="hf"), cls(model_dir, preprocess="torch"), model_dir


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_frames_patched_by_the_tower_give_the_host_rows_and_embedding(encoders, clip):
    host, device, model_dir = encoders
    assert not host.patches_videos_on_device and device.patches_videos_on_device
    job = _job(model_dir, CLIPS[clip])
    rows = job.decode()
    frames = job.decode(patch=False)
    assert frames.pixel_values is None and frames.frames.dtype == torch.uint8 and frames.frames.ndim == 4
    assert frames.grid == rows.grid == tuple(job.plan.grid) and frames.timing == rows.timing
    assert torch.equal(device._rows(frames), rows.pixel_values)
    (want,), (got,) = host.encode_prepared([rows]), device.encode_prepared([frames])
    assert torch.equal(got, want)


def test_frames_to_rows_is_video_patches_for_the_grid_it_gives(qwen_model_dir):
    config = load_qwen_video_config(qwen_model_dir)
    frames = torch.randint(0, 256, (5, 180, 240, 3), dtype=torch.uint8)
    rows, grid = video_patches(frames.numpy(), config)
    assert grid[0] == 3  # 5 frames: the last repeated to fill the third group
    assert torch.equal(frames_to_rows(frames, grid, config), rows)


def test_frames_resized_a_few_at_a_time_are_the_frames_resized_at_once():
    """A GPU bounds its float32 working set by resizing a few frames at a time: the same pixels."""
    frames = torch.randint(0, 256, (7, 180, 240, 3), dtype=torch.uint8)
    whole = resize_frames(frames.permute(0, 3, 1, 2).contiguous(), (168, 252))
    two_at_a_time = resized_frames(frames, (168, 252), torch.device("cpu"), chunk_bytes=2 * 180 * 240 * 3 * 4)
    assert torch.equal(two_at_a_time, whole)
    on_grid = resized_frames(frames, (180, 240), torch.device("cpu"))
    assert torch.equal(on_grid, frames.permute(0, 3, 1, 2))


def test_the_lane_hands_over_frames_when_the_tower_patches(qwen_model_dir):
    cache = EmbeddingCache(TensorArena(1 << 16))
    submitted, arrived = [], threading.Event()

    def submit(key, job, priority):
        submitted.append(job)
        arrived.set()

    lane = VideoLane(cache, submit, threads=1, patch_on_device=True)
    cache.acquire("k", want_lease=False, video=True)
    lane.start("k", _job(qwen_model_dir, CLIPS["resized"]), 0)
    assert arrived.wait(30)
    (job,) = submitted
    assert job.prepared.frames is not None and job.prepared.pixel_values is None
    assert job.prepare() is job.prepared
    lane.shutdown()
