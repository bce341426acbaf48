"""Qwen3VisionEncoder: the HF image processor and our tower give HF's [parts, tokens, hidden] per image."""

from __future__ import annotations

import torch

from common.vision.qwen3_encoder import Qwen3VisionEncoder


def test_encode_equals_hf(qwen3_model_dir, qwen3_oracle, qwen_images):
    encoder = Qwen3VisionEncoder(qwen3_model_dir)
    assert encoder.preprocess_mode == "hf" and encoder.parts == 4
    ours = encoder.encode(qwen_images)
    refs = qwen3_oracle.image_features(*qwen3_oracle.pixels(qwen_images))
    for image, mine, ref in zip(qwen_images, ours, refs, strict=True):
        grid = encoder.layout.grid(image.height, image.width, encoder.default_pixels)
        assert mine.shape == (4, encoder.layout.num_tokens(grid), 64) == ref.shape
        assert torch.equal(mine, ref)  # max abs diff 0 in fp32
        assert encoder.nbytes_for(grid) == mine.numel() * mine.element_size()
    assert (encoder.calls, encoder.images_encoded) == (1, 3)
    encoder.warm_up()
