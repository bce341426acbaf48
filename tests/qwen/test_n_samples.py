"""n samples forked from one prefill on Qwen2.5-VL: the samples share the prompt's M-RoPE positions, and
each has the tokens of a request of its own seeded seed + i."""

from __future__ import annotations

import pytest

from tests.n_samples import check_samples_match_seeded_requests

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture?<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_samples_share_the_prefill_and_its_mrope_positions(qwen_model_dir, qwen_images, async_scheduling):
    check_samples_match_seeded_requests(qwen_model_dir, PROMPT, qwen_images[:1],
                                        async_scheduling=async_scheduling)
