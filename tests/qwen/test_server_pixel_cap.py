"""The server's cap on image tokens (`--max-image-tokens`, EngineConfig.max_image_tokens) bounds every
image's max_pixels below the checkpoint's (README, "Images"): an image sent without a range is resized
under the cap, and a per-image max_pixels above the cap but below the checkpoint's maximum is refused
(INVALID_ARGUMENT at the service), for Qwen2.5-VL (28 px blocks) and Qwen3-VL (32 px blocks)."""

from __future__ import annotations

import json

import pytest

from decoder_svc.engine import EngineConfig, InvalidRequestError, LLMEngine
from decoder_svc.engine.input_processor import ImageOptions
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all

CAP_TOKENS = 100  # far below either checkpoint's maximum (16384 blocks)
N = 8
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture?"
       "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(params=["qwen2.5", "qwen3"])
def capped(request):
    """(engine with the cap, the checkpoint's max_pixels, the cap in pixels) of each family."""
    model_dir = request.getfixturevalue("qwen_model_dir" if request.param == "qwen2.5" else "qwen3_model_dir")
    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    block = processor["patch_size"] * processor["merge_size"]  # 28 or 32 px: one image token
    config = EngineConfig(model=model_dir, num_kv_blocks=64, max_image_tokens=CAP_TOKENS)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    return engine, processor["size"]["longest_edge"], CAP_TOKENS * block * block


def test_a_range_above_the_servers_cap_is_refused(capped, qwen_images):
    """max_pixels of twice the cap: inside the checkpoint's range, outside the server's."""
    engine, checkpoint_max, cap = capped
    asked = 2 * cap
    assert asked < checkpoint_max  # the case the checkpoint's bound alone would let through
    with pytest.raises(InvalidRequestError, match=f"max_pixels {asked} is above the server's limit of {cap}"):
        engine.add_request("over", ONE, [qwen_images[1]], sampling=greedy(N),
                           image_options=[ImageOptions(max_pixels=asked)])
    # The engine goes on serving, and the refused request held nothing.
    ok = engine.add_request("at-cap", ONE, [qwen_images[1]], sampling=greedy(N),
                            image_options=[ImageOptions(max_pixels=cap)])
    assert ok.images[0].pixels.max_pixels == cap
    assert run_all(engine)["at-cap"]["error"] is None
    assert engine.stats().kv_blocks_used == 0 and engine.source.num_leases == 0


def test_an_image_without_a_range_is_resized_under_the_cap(capped, qwen_images):
    """640x480 is 391 tokens (Qwen2.5-VL) at the checkpoint's range; under the cap it is resized to at
    most CAP_TOKENS tokens, never refused."""
    engine, _, cap = capped
    req = engine.add_request("default", ONE, [qwen_images[1]], sampling=greedy(N))
    assert req.images[0].pixels.max_pixels == cap
    assert 0 < req.images[0].length <= CAP_TOKENS


def test_capped_image_equals_hf_at_the_caps_range(make_qwen_engine, qwen_oracle, qwen_images):
    """The resized image is HF's image at max_pixels = the cap (Qwen2.5-VL: 100 x 28 x 28 pixels)."""
    engine = make_qwen_engine(max_image_tokens=CAP_TOKENS)
    engine.add_request("capped", ONE, [qwen_images[1]], sampling=greedy(N))
    tokens = run_all(engine)["capped"]["tokens"]
    assert tokens == qwen_oracle.generate(ONE, [qwen_images[1]], N, [(3136, CAP_TOKENS * 28 * 28)])
