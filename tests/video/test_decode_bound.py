"""What a request asked for bounds what its video costs (issue 63): a sampled frame far from any keyframe
(a long video of one group of pictures) is not reached by decoding every frame before it. Past
--max-video-decode-per-frame frames decoded per frame kept, each sampled frame moves to the nearest frame
before it within that share, and the plan (both services') reports that frame's timestamp. Counted in
frames, never timed."""

from __future__ import annotations

import numpy as np
import pytest

from common.families.qwen2_5_vl.video_config import QWEN3_VL_VIDEO
from common.video.decode import decode_video
from common.video.limits import VideoLimits
from common.video.pipeline import plan_video
from common.video.schedule import PacketIndex, bounded_indices, schedule_decoding
from tests.video.media import make_video

K = VideoLimits().max_decode_per_frame


@pytest.fixture(scope="module")
def one_gop() -> bytes:
    """600 frames (60 s at 10 fps) with a single keyframe: only decodable from the start."""
    return make_video(600, fps=10, gop_size=10000, still=True)


def test_the_default_share_is_near_64():
    assert 32 <= K <= 128


def test_sampled_frames_move_to_the_nearest_frame_within_their_share():
    index = PacketIndex(tuple(range(0, 6000, 10)), (0, 300))
    chosen = bounded_indices(index, [100, 350, 599], per_frame=10)
    assert chosen == [9, 309, 319]  # on from the start, from keyframe 300, then on from 309
    assert schedule_decoding(index, chosen).frames_to_decode <= 3 * 10
    assert bounded_indices(None, [100, 350, 599], per_frame=10) == [9, 19, 29]  # no index: in order only
    assert bounded_indices(index, [3, 302], per_frame=10) == [3, 302]  # within its share: unchanged


def test_a_one_gop_video_decodes_at_most_k_frames_per_frame_kept(one_gop):
    video = decode_video(one_gop, lambda info: np.array([0, 599]))
    assert video.indices.tolist() == [0, K]
    assert video.frames_decoded <= 2 * K, "every frame before the last sampled one was decoded"
    unbounded = decode_video(one_gop, lambda info: np.array([0, 599]), VideoLimits(max_decode_per_frame=0))
    assert unbounded.indices.tolist() == [0, 599] and unbounded.frames_decoded == 600


def test_the_plan_reports_the_timestamps_of_the_frames_used(one_gop):
    config = QWEN3_VL_VIDEO.with_request(max_frames=2)
    plan = plan_video(one_gop, config, "fp")
    nominal = plan_video(one_gop, config, "fp", limits=VideoLimits(max_decode_per_frame=0))
    assert plan.frames_to_decode <= K * len(plan.indices) < nominal.frames_to_decode
    assert plan.grid == nominal.grid and plan.num_tokens == nominal.num_tokens  # the same frames kept
    assert plan.indices[-1] < nominal.indices[-1]
    assert plan.timing == config.timing(plan.indices, plan.info.total_frames, plan.info.fps)
    assert plan.timing.timestamps != nominal.timing.timestamps


def test_a_video_with_keyframes_near_its_sampled_frames_is_unchanged():
    video = make_video(600, fps=10, gop_size=30)
    sampled = [0, 200, 420, 599]
    assert decode_video(video, lambda info: np.array(sampled)).indices.tolist() == sampled
