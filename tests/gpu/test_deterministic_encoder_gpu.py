"""The encoder's --deterministic mode on a CUDA device: one image per forward gives the same bits alone,
replayed from a CUDA graph, eagerly, after other images, and in another order; a mixed batch (the mode
off) is printed beside for the record."""

from __future__ import annotations

import pytest
import torch

from common.vision import attention
from common.vision.encoders import make_vision_encoder


@pytest.mark.parametrize("family", ["qwen", "qwen3"])
def test_one_image_forwards_are_the_same_bits_however_they_run(family, qwen_model_dir, qwen3_model_dir,
                                                               qwen_images):
    model_dir = qwen_model_dir if family == "qwen" else qwen3_model_dir
    attention.use_fixed_choices()
    try:
        gpu = make_vision_encoder(model_dir, "cuda", torch.bfloat16)
        assert gpu.capture_graphs(8)
        prepared = [gpu.prepare(image) for image in qwen_images]
        eager = [gpu.encode_prepared([p])[0] for p in prepared]
        for _ in range(3):  # captured at the second sight, then replayed
            replayed = [gpu.encode_prepared([p], use_graphs=True)[0] for p in reversed(prepared)][::-1]
        assert gpu.graphs.replays >= len(prepared)
        for e, r in zip(eager, replayed, strict=True):
            assert torch.equal(e, r)
        batched = gpu.encode_prepared(prepared)  # one forward over all three: what the mode avoids
        diffs = [(b.float() - e.float()).abs().max().item() for b, e in zip(batched, eager, strict=True)]
        print(f"\n{family}: a mixed batch's rows against one-image forwards, max |diff| per image: {diffs}")
    finally:
        attention.use_fixed_choices(False)
