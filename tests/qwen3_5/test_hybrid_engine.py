"""The hybrid stack in the engine beyond plain parity: a video (Qwen3-VL's timestamped frame groups)
equal to HF's generate, n samples forked from one prefill (the parent's state copied into each child's
slot), and tensor parallelism, which does not cover linear layers, refusing them."""

from __future__ import annotations

import pytest

from common.checkpoint import CheckpointError
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import text_config_dict
from decoder_svc.model.parallel import TensorParallel
from tests.n_samples import check_samples_match_seeded_requests
from tests.oracle import greedy
from tests.video.test_engine_video import VIDEO, VIDEO_PROMPT, VideoOracle

N = 8
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture?<|im_end|>\n"
       "<|im_start|>assistant\n")


def test_one_video_equals_hf(make_qwen3_5_engine, qwen3_5_oracle, qwen3_5_model_dir):
    engine = make_qwen3_5_engine(max_num_batched_tokens=64)
    out = engine.generate("v", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert out.error is None, out.error
    ref = VideoOracle(qwen3_5_oracle, qwen3_5_model_dir).generate(VIDEO_PROMPT, [], [VIDEO], N)
    assert out.new_token_ids == ref and len(set(ref)) > 3
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and engine.source.num_leases == 0


def test_n_samples_fork_the_state(qwen3_5_model_dir, qwen_images):
    """Three seeded samples of one prefill give what three seeded requests give (two forked: their
    slots start from a copy of the parent's state); nothing held after."""
    check_samples_match_seeded_requests(qwen3_5_model_dir, ONE, qwen_images[:1])


def test_tensor_parallelism_refuses_linear_layers(qwen3_5_model_dir):
    """(The deterministic mode covers them: test_deterministic.py.)"""
    cfg = TextModelConfig.from_hf(text_config_dict(qwen3_5_model_dir))
    with pytest.raises(CheckpointError, match="hybrid stack .* is not split over tensor-parallel ranks"):
        TensorParallel(0, 2).check(cfg)
