"""Qwen3-VL wired into the shared code: the vision-encoder factory, the image layout (grids and token counts
from the header, as the decoder's tokenizer uses them) and the decoder's in-process embedding source."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import CheckpointError
from common.families.qwen2_5_vl.encoder import QwenVisionEncoder
from common.families.qwen2_5_vl.layout import load_qwen_layout
from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
from common.families.qwen3_vl.oracle import IMAGE_PAD
from common.images import encode_png
from common.vision.encoders import make_vision_encoder, takes_pixel_ranges
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.tokenization import PromptTokenizer


def test_factory_and_layout(qwen3_model_dir, qwen_model_dir):
    encoder = make_vision_encoder(qwen3_model_dir)
    assert isinstance(encoder, Qwen3VisionEncoder) and takes_pixel_ranges(encoder)
    assert isinstance(make_vision_encoder(qwen_model_dir), QwenVisionEncoder)
    with pytest.raises(CheckpointError, match="not a Qwen2.5-VL"):
        QwenVisionEncoder(qwen3_model_dir)  # same layout, another tower
    layout = load_qwen_layout(qwen3_model_dir)
    assert (layout.patch_size, layout.merge_size, layout.factor) == (16, 2, 32)
    assert (layout.min_pixels, layout.max_pixels) == (65536, 16777216)  # preprocessor_config.json
    assert layout == encoder.layout


def test_header_counts_equal_hf_prompt(qwen3_model_dir, qwen3_oracle, qwen_images):
    """The decoder's tokenizer, given counts from the layout (image sizes only), makes HF's input ids."""
    layout = load_qwen_layout(qwen3_model_dir)
    pixels = layout.pixel_range()
    counts = [layout.num_tokens(layout.grid(i.height, i.width, pixels)) for i in qwen_images]
    _, hf_grids = qwen3_oracle.pixels(qwen_images)
    assert counts == [int(g.prod()) // 4 for g in hf_grids] == [64, 300, 279]
    tokenizer = PromptTokenizer(qwen3_model_dir)
    assert tokenizer.layout == layout and tokenizer.image_token == IMAGE_PAD
    prompt = f"<|im_start|>user\n{IMAGE_PAD}a{IMAGE_PAD}b{IMAGE_PAD}?<|im_end|>\n"
    ours = tokenizer.encode_prompt(prompt, image_token_counts=counts)
    assert ours.token_ids == qwen3_oracle.inputs(prompt, qwen_images)["input_ids"][0].tolist()
    assert [p.length for p in ours.placeholders] == counts


def test_local_source_gives_every_part(qwen3_model_dir, qwen3_oracle, qwen_images):
    source = LocalEmbeddingSource(qwen3_model_dir)
    expected = qwen3_oracle.image_features(*qwen3_oracle.pixels(qwen_images[1:2]))[0]
    pixels = source.encoder.layout.pixel_range()
    for rid in ("r1", "r2"):  # the second is a hit of the first's entry
        source.request(EmbeddingRequest(rid, "ab" * 32, encode_png(qwen_images[1]), pixels=pixels))
        assert source.poll(rid, "ab" * 32) == EmbeddingState.READY
        got = source.get(rid, "ab" * 32)
        assert got.shape == (4, 300, 64) and torch.equal(got, expected)
    assert (source.num_encoded, source.num_cache_hits) == (1, 1)
    source.release("r1")
    source.release("r2")
    assert source.num_leases == 0
