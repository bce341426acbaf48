"""Served tokens equal HF Qwen3VLMoeForConditionalGeneration.generate (fp32, greedy) on qwen3-vl-moe-tiny:
the routed experts (top-3 of 8, renormalised) in every layer, with Qwen3-VL's DeepStack levels,
interleaved M-RoPE and video path; whatever the chunk size, cache state and batch company."""

from __future__ import annotations

import decoder_svc.model.moe as moe_module
from decoder_svc.engine.embedding_source import VideoSource
from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, THREE, tokens_equal_hf
from tests.video.test_engine_video import VIDEO, VIDEO_PROMPT, VideoOracle

N = 12


def _check(engine, oracle, prompt, imgs, rid="r", n=N):
    out = tokens_equal_hf(engine, oracle, prompt, imgs, rid, n=n)
    assert len(set(out.new_token_ids)) > 3  # the random model's greedy output varies (they are HF's)
    return out


def test_text_only(make_qwen3_moe_engine, qwen3_moe_oracle):
    _check(make_qwen3_moe_engine(), qwen3_moe_oracle, TEXT, [])


def test_images_in_chunks_that_split_them_then_a_prefix_hit(make_qwen3_moe_engine, qwen3_moe_oracle,
                                                             qwen_images):
    """One image, then three of different sizes, prefilled 13 tokens at a time (chunks inside images);
    the three again: their KV is reused and the images are not fetched."""
    engine = make_qwen3_moe_engine(max_num_batched_tokens=13)
    assert _check(engine, qwen3_moe_oracle, ONE, qwen_images[:1], rid="one").usage.images == 1
    cold = _check(engine, qwen3_moe_oracle, THREE, qwen_images, rid="three")
    warm = engine.generate("warm", THREE, qwen_images, sampling=greedy(N))
    assert warm.new_token_ids == cold.new_token_ids
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16
    assert warm.usage.images_skipped_by_kv_reuse == 3
    assert engine.stats().kv_blocks_used == 0 and engine.source.num_leases == 0


def test_concurrent_requests_batch_their_tokens(make_qwen3_moe_engine, qwen3_moe_oracle, qwen_images):
    """Four requests in one batch: each token is routed on its own, so company changes nothing."""
    engine = make_qwen3_moe_engine(max_num_batched_tokens=256, max_num_seqs=4)
    plan = [(TEXT, []), (ONE, qwen_images[:1]), (ONE, qwen_images[2:]), (TEXT.replace("red", "blue"), [])]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"c{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"c{i}"]["tokens"] == qwen3_moe_oracle.generate(prompt, imgs, N), f"request c{i}"


def test_one_video(make_qwen3_moe_engine, qwen3_moe_oracle, qwen3_moe_model_dir):
    engine = make_qwen3_moe_engine(max_num_batched_tokens=64)
    out = engine.generate("v", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert out.error is None, out.error
    assert out.new_token_ids == VideoOracle(qwen3_moe_oracle, qwen3_moe_model_dir).generate(
        VIDEO_PROMPT, [], [VIDEO], N)


def test_renormalisation_matters(make_qwen3_moe_engine, qwen3_moe_oracle, monkeypatch):
    """Without renormalising the top-k weights the tokens differ from HF's: the parity above depends on
    the router's normalisation."""
    route = moe_module.route
    monkeypatch.setattr(moe_module, "route", lambda logits, k, renormalize: route(logits, k, False))
    out = make_qwen3_moe_engine().generate("r", TEXT, [], sampling=greedy(N))
    assert out.new_token_ids != qwen3_moe_oracle.generate(TEXT, [], N)
