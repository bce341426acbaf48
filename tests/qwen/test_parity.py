"""Served tokens equal HF Qwen2_5_VLForConditionalGeneration.generate (fp32, greedy) on the tiny preset,
whatever the chunk size (chunks that split images), cache state, batch company and preemptions."""

from __future__ import annotations

import functools

import pytest
import torch

from common.image_geometry import PixelRange
from decoder_svc.engine.input_processor import ImageOptions
from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, THREE, tokens_equal_hf

N = 12

_check = functools.partial(tokens_equal_hf, n=N)


def test_outputs_vary(qwen_oracle, qwen_images):
    """The preset's weights are scaled so that greedy output is not one repeated token."""
    assert len(set(qwen_oracle.generate(ONE, qwen_images[:1], N))) > N // 2


def test_embeddings_equal_hf(make_qwen_engine, qwen_oracle, qwen_images):
    source = make_qwen_engine().source
    ours = source.encoder.encode(qwen_images)
    for mine, ref in zip(ours, qwen_oracle.image_features(qwen_images), strict=True):
        assert mine.shape == ref.shape
        assert torch.equal(mine, ref)  # max abs diff 0 in fp32


def test_text_only(make_qwen_engine, qwen_oracle):
    _check(make_qwen_engine(), qwen_oracle, TEXT, [])


@pytest.mark.parametrize("budget", [7, 13, 64, 2048])
def test_one_and_three_images_any_chunk_size(make_qwen_engine, qwen_oracle, qwen_images, budget):
    """One image; three images of different sizes in one request; chunk boundaries inside images."""
    engine = make_qwen_engine(max_num_batched_tokens=budget)
    one = _check(engine, qwen_oracle, ONE, qwen_images[:1], rid="one")
    assert one.usage.images == 1
    three = _check(engine, qwen_oracle, THREE, qwen_images, rid="three")
    assert three.usage.images == 3
    assert engine.stats().kv_blocks_used == 0


def test_chat_template(make_qwen_engine, qwen_oracle, qwen_images):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "what differs?"}]}]
    engine = make_qwen_engine(max_num_batched_tokens=64)
    out = engine.generate("chat", messages=messages, images=qwen_images[1:], sampling=greedy(N))
    assert out.new_token_ids == qwen_oracle.generate(qwen_oracle.chat_text(messages), qwen_images[1:], N)


def test_prefix_reuse_keeps_positions(make_qwen_engine, qwen_oracle, qwen_images):
    """The same images again: their KV is reused (positions stay those of the cached blocks)."""
    engine = make_qwen_engine(max_num_batched_tokens=64)
    cold = _check(engine, qwen_oracle, THREE, qwen_images, rid="cold")
    warm = _check(engine, qwen_oracle, THREE, qwen_images, rid="warm")
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16
    assert warm.usage.images_skipped_by_kv_reuse == 3


def test_concurrent_requests_and_preemption(make_qwen_engine, qwen_oracle, qwen_images):
    """Eight requests at once in a KV pool too small for all: batches mix prefill and decode, some
    requests are preempted and recomputed."""
    engine = make_qwen_engine(max_num_batched_tokens=256, num_kv_blocks=90, max_num_seqs=8)
    plan = [(ONE, [qwen_images[i % 3]]) if i % 3 else (THREE if i % 2 else TEXT, qwen_images if i % 2 else [])
            for i in range(8)]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"c{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"c{i}"]["tokens"] == qwen_oracle.generate(prompt, imgs, N), f"request c{i}"
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0
    assert engine.scheduler.images.num_held == 0 and engine.source.num_leases == 0


def test_hash_only_after_bytes(make_qwen_engine, qwen_oracle, qwen_images):
    """A request by content hash alone, after the image was sent once: its grid is remembered (prefix
    caching off, so the image is fetched from the encoder cache rather than skipped)."""
    engine = make_qwen_engine(enable_prefix_caching=False)
    first = engine.add_request("bytes", ONE, [qwen_images[1]], sampling=greedy(N))
    key = first.images[0].content_hash
    run_all(engine)
    out = engine.generate("hash", ONE, [key], sampling=greedy(N))
    assert out.new_token_ids == qwen_oracle.generate(ONE, [qwen_images[1]], N)
    assert out.usage.images_encoder_cache_hits == 1


def test_per_image_pixel_range(make_qwen_engine, qwen_oracle, qwen_images):
    """A request may lower max_pixels: fewer tokens, another cache entry, still equal to HF."""
    engine = make_qwen_engine()
    small = engine.add_request("small", ONE, [qwen_images[1]], sampling=greedy(N),
                               image_options=[ImageOptions(max_pixels=100_000)])
    assert small.images[0].length == 117 and small.images[0].pixels == PixelRange(3136, 100_000)
    full = engine.add_request("full", ONE, [qwen_images[1]], sampling=greedy(N))
    assert full.images[0].content_hash != small.images[0].content_hash
    results = run_all(engine)
    assert results["small"]["tokens"] == qwen_oracle.generate(ONE, [qwen_images[1]], N, [(3136, 100_000)])
    assert results["full"]["tokens"] == qwen_oracle.generate(ONE, [qwen_images[1]], N)
