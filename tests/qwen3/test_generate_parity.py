"""Served tokens equal HF Qwen3VLForConditionalGeneration.generate (fp32, greedy) on qwen3-vl-tiny:
DeepStack levels added after the first layers at the image rows, interleaved M-RoPE and per-head q/k
norms, whatever the chunk size (chunks that split images), cache state, batch company and preemptions."""

from __future__ import annotations

import functools

import pytest

import decoder_svc.runner.model_runner as runner_module
from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, THREE, tokens_equal_hf

N = 12

_check = functools.partial(tokens_equal_hf, n=N)


def test_text_only(make_qwen3_engine, qwen3_oracle):
    _check(make_qwen3_engine(), qwen3_oracle, TEXT, [])


@pytest.mark.parametrize("budget", [7, 13, 64, 2048])
def test_one_and_three_images_any_chunk_size(make_qwen3_engine, qwen3_oracle, qwen_images, budget):
    """One image; three images of different sizes in one request; chunk boundaries inside images (the
    DeepStack rows of a chunk are the chunk's own)."""
    engine = make_qwen3_engine(max_num_batched_tokens=budget)
    assert _check(engine, qwen3_oracle, ONE, qwen_images[:1], rid="one").usage.images == 1
    assert _check(engine, qwen3_oracle, THREE, qwen_images, rid="three").usage.images == 3
    assert engine.stats().kv_blocks_used == 0 and engine.source.num_leases == 0


def test_deepstack_levels_matter(make_qwen3_engine, qwen3_oracle, qwen_images, monkeypatch):
    """Without the DeepStack levels the tokens differ from HF's: the parity above depends on them."""
    fuse = runner_module.fuse_image_rows
    monkeypatch.setattr(runner_module, "fuse_image_rows", lambda *a: (fuse(*a), None)[1])
    out = make_qwen3_engine().generate("r", THREE, qwen_images, sampling=greedy(N))
    assert out.new_token_ids != qwen3_oracle.generate(THREE, qwen_images, N)


def test_chat_template(make_qwen3_engine, qwen3_oracle, qwen_images):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "what differs?"}]}]
    engine = make_qwen3_engine(max_num_batched_tokens=64)
    out = engine.generate("chat", messages=messages, images=qwen_images[1:], sampling=greedy(N))
    text = qwen3_oracle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.new_token_ids == qwen3_oracle.generate(text, qwen_images[1:], N)


def test_prefix_reuse_needs_no_parts(make_qwen3_engine, qwen3_oracle, qwen_images):
    """The same images again: their KV (DeepStack already inside it) is reused, the images are never
    fetched, and the tokens still equal HF's."""
    engine = make_qwen3_engine(max_num_batched_tokens=64)
    cold = _check(engine, qwen3_oracle, THREE, qwen_images, rid="cold")
    warm = _check(engine, qwen3_oracle, THREE, qwen_images, rid="warm")
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16
    assert warm.usage.images_skipped_by_kv_reuse == 3


def test_eight_concurrent_requests_and_preemption(make_qwen3_engine, qwen3_oracle, qwen_images):
    engine = make_qwen3_engine(max_num_batched_tokens=256, num_kv_blocks=90, max_num_seqs=8)
    plan = [(ONE, [qwen_images[i % 3]]) if i % 3 else (THREE if i % 2 else TEXT, qwen_images if i % 2 else [])
            for i in range(8)]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"c{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"c{i}"]["tokens"] == qwen3_oracle.generate(prompt, imgs, N), f"request c{i}"
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0
    assert engine.scheduler.images.num_held == 0 and engine.source.num_leases == 0


def test_hash_only_after_bytes(make_qwen3_engine, qwen3_oracle, qwen_images):
    """A request by content hash alone after the image was sent once (its grid remembered)."""
    engine = make_qwen3_engine(enable_prefix_caching=False)
    key = engine.add_request("bytes", ONE, [qwen_images[1]], sampling=greedy(N)).images[0].content_hash
    run_all(engine)
    out = engine.generate("hash", ONE, [key], sampling=greedy(N))
    assert out.new_token_ids == qwen3_oracle.generate(ONE, [qwen_images[1]], N)
    assert out.usage.images_encoder_cache_hits == 1
