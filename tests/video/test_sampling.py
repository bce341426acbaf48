"""Frame sampling and timestamps against Hugging Face's own functions (and hand-computed cases)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from common.families.qwen2_5_vl.video_sampling import (
    FrameSampling,
    qwen2_vl_frame_indices,
    qwen3_vl_frame_indices,
)
from common.families.qwen2_5_vl.video_timing import (
    qwen2_5_vl_second_per_grid,
    qwen3_vl_timestamp_text,
    qwen3_vl_timestamps,
)
from common.video.limits import VideoError
from tests.video.hf_source import qwen2_vl_function

TOTALS = [2, 3, 4, 5, 7, 16, 17, 30, 37, 49, 60, 97, 241, 1000, 5000]
VIDEO_FPS = [1.0, 10.0, 12.0, 23.976, 25.0, 29.97, 60.0]
FPS = [0.5, 1.0, 2.0, 3.7]
MAX_FRAMES = [768, 8, 5]


@pytest.fixture(scope="module")
def hf_qwen2_sample():
    """Qwen2VLVideoProcessor.sample_frames (video_processing_qwen2_vl.py), compiled from HF's source."""
    fn = qwen2_vl_function("sample_frames")

    def sample(total, video_fps, fps, max_frames):
        self = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                               max_frames=max_frames)
        return fn(self, VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps).numpy()

    return sample


def test_qwen2_indices_equal_hf(hf_qwen2_sample) -> None:
    for total, video_fps, fps, top in itertools.product(TOTALS, VIDEO_FPS, FPS, MAX_FRAMES):
        ours = qwen2_vl_frame_indices(total, video_fps, fps=fps, max_frames=top)
        theirs = hf_qwen2_sample(total, video_fps, fps, top)
        # HF's PyAV reader (video_utils.read_video_pyav) only meets indices below the frame count
        assert ours.tolist() == theirs[theirs < total].tolist(), (total, video_fps, fps, top)
        assert len(ours) % 2 == 0 and len(set(ours.tolist())) == len(ours)


def test_qwen3_indices_equal_hf() -> None:
    hf = Qwen3VLVideoProcessor()  # imports and samples without torchvision
    for total, video_fps, fps, top in itertools.product(TOTALS, VIDEO_FPS, FPS, MAX_FRAMES):
        hf.max_frames = top
        theirs = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps)
        ours = qwen3_vl_frame_indices(total, video_fps, fps=fps, max_frames=top)
        assert ours.tolist() == theirs.tolist(), (total, video_fps, fps, top)


def test_qwen3_defaults_are_hfs() -> None:
    hf = Qwen3VLVideoProcessor()
    ours = FrameSampling("qwen3_vl", fps=2)
    assert (hf.fps, hf.min_frames, hf.max_frames, hf.temporal_patch_size) == (
        ours.fps, ours.min_frames, ours.max_frames, ours.temporal_patch_size)


def test_hand_computed_cases(hf_qwen2_sample) -> None:
    # Qwen2VLVideoProcessor.sample_frames: n = floor(min(max(total / video_fps * fps, 4), max_frames', total)
    # / 2) * 2, max_frames' = floor(min(768, total) / 2) * 2; indices = arange(0, total, total / n).int()
    # 60 frames at 30 fps, fps 2: n = 4 -> step 15
    assert qwen2_vl_frame_indices(60, 30.0, 2.0).tolist() == [0, 15, 30, 45]
    # 10 s at 10 fps, fps 1: n = 10 -> step 10
    assert qwen2_vl_frame_indices(100, 10.0, 1.0).tolist() == list(range(0, 100, 10))
    # 3 frames: n = floor(min(4, 2, 3) / 2) * 2 = 2 -> step 1.5 -> 0, 1
    assert qwen2_vl_frame_indices(3, 30.0, 2.0).tolist() == [0, 1]
    # float32 arange: 17 frames, n = floor(14.11 / 2) * 2 = 14 -> step 17/14; its 15th index is 17, past
    # the last frame, which HF's reader never decodes
    hf = hf_qwen2_sample(17, 1.0, 0.83, 768)
    assert hf.tolist()[-1] == 17 and len(hf) == 15
    assert qwen2_vl_frame_indices(17, 1.0, 0.83).tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15]
    # Qwen3VLVideoProcessor.sample_frames: n = min(max(int(total / video_fps * fps), 4), 768, total);
    # indices = linspace(0, total - 1, n).round(). 60 frames at 30 fps, fps 2: n = 4 -> 0, 19.67, 39.33, 59
    assert qwen3_vl_frame_indices(60, 30.0, 2.0).tolist() == [0, 20, 39, 59]
    # 25 frames at 10 fps, fps 2: int(5.0) = 5 frames (odd: the patcher repeats the last)
    assert qwen3_vl_frame_indices(25, 10.0, 2.0).tolist() == [0, 6, 12, 18, 24]


def test_too_few_frames_is_a_video_error() -> None:
    for fn in (qwen2_vl_frame_indices, qwen3_vl_frame_indices):
        with pytest.raises(VideoError, match="shorter than one temporal patch of 2"):
            fn(1, 30.0)


def test_sampling_rejects_bad_parameters() -> None:
    with pytest.raises(VideoError, match="fps"):
        FrameSampling("qwen3_vl", fps=0)
    with pytest.raises(VideoError, match="max_frames"):
        FrameSampling("qwen2_vl", max_frames=1)
    with pytest.raises(ValueError, match="sampling method"):
        FrameSampling("llava")


def test_qwen3_timestamps_equal_hf() -> None:
    for total, video_fps in itertools.product([7, 25, 60, 241], [10.0, 23.976, 30.0]):
        indices = qwen3_vl_frame_indices(total, video_fps)
        # _calculate_timestamps does not use self
        theirs = Qwen3VLProcessor._calculate_timestamps(None, indices, video_fps, 2)
        ours = qwen3_vl_timestamps(indices, video_fps, 2)
        assert ours == theirs
        assert len(ours) == -(-len(indices) // 2)  # one per temporal group
    # hand-computed: frames 0, 6, 12, 18, 24 at 10 fps; pad to 24; groups (0, .6), (1.2, 1.8), (2.4, 2.4)
    assert qwen3_vl_timestamps([0, 6, 12, 18, 24], 10.0) == pytest.approx([0.3, 1.5, 2.4])
    assert qwen3_vl_timestamp_text(1.25) == "<1.2 seconds>"  # replace_video_token's f"<{t:.1f} seconds>"


def test_qwen2_5_second_per_grid() -> None:
    # Qwen2_5_VLProcessor._process_videos: temporal_patch_size / VideoMetadata.sampled_fps
    metadata = VideoMetadata(total_num_frames=60, fps=30.0, frames_indices=list(range(0, 60, 15)))
    assert qwen2_5_vl_second_per_grid(4, 60, 30.0) == pytest.approx(2 / metadata.sampled_fps)
    assert qwen2_5_vl_second_per_grid(4, 60, 30.0) == pytest.approx(1.0)
    assert np.isfinite(qwen2_5_vl_second_per_grid(3, 7, 23.976))
