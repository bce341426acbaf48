"""Prefix reuse over the linear layers' state (engine/state_snapshots.py): a follow-up about the same image
resumes from the snapshot taken at the image's end (the image is not read again up to there), the same
prompt again from the one at its last block boundary, chunked or not; tokens equal HF's; the snapshots
are kept under an LRU budget, and a request never resumes from KV alone."""

from __future__ import annotations

import torch

from tests.oracle import greedy
from tests.qwen_prompts import END, USER, VISION

N = 6


def ask(question: str) -> str:
    return USER + VISION + question + END


def _check(engine, oracle, prompt, imgs, rid):
    """Tokens equal HF's, and the first one's logprob too (to 1e-4: a state resumed wrongly can still
    give the same greedy tokens, not the same logits)."""
    out = engine.generate(rid, prompt, imgs, sampling=greedy(N, logprobs=1))
    assert out.error is None, out.error
    assert out.new_token_ids == oracle.generate(prompt, imgs, N), "tokens differ from HF"
    with torch.no_grad():
        logits = oracle.model(**oracle.inputs(prompt, imgs)).logits[0, -1].float()
    ref = float(torch.log_softmax(logits, -1)[out.new_token_ids[0]])
    assert abs(out.logprobs[0].logprob - ref) < 1e-4, (out.logprobs[0].logprob, ref)
    return out.usage


def test_a_new_question_about_the_same_image_resumes_at_its_end(make_qwen3_5_engine, qwen3_5_oracle,
                                                                  qwen_images):
    engine = make_qwen3_5_engine(max_num_batched_tokens=32)  # chunks cut the image
    image = [qwen_images[0]]
    cold = _check(engine, qwen3_5_oracle, ask("what is in the picture?"), image, "cold")
    taken = engine.stats().state_snapshots_taken
    assert cold.cached_prompt_tokens == 0 and taken >= 2  # the image's end and the prompt's last block
    warm = _check(engine, qwen3_5_oracle, ask("which colours are there?"), image, "warm")
    stats = engine.stats()
    assert warm.cached_prompt_tokens > 0 and stats.state_snapshot_hits == 1
    assert warm.cached_prompt_tokens % 16 == 0 and warm.cached_prompt_tokens <= warm.prompt_tokens - 1
    assert stats.state_snapshots_held == stats.state_snapshots_taken
    assert stats.state_snapshot_bytes == stats.state_snapshots_held * _bytes_per_snapshot(engine)
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_the_same_prompt_again_resumes_at_its_last_block(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    engine = make_qwen3_5_engine()
    prompt = ask("what is in the picture?")
    _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "cold")
    warm = _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "warm")
    assert warm.cached_prompt_tokens == (warm.prompt_tokens - 1) // 16 * 16
    assert warm.images_skipped_by_kv_reuse == 1


def test_snapshots_are_kept_under_a_budget(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    """Two snapshot slots, one snapshot per block: each cold prompt takes two (the rest of its one chunk's
    find every slot pending), evicting the older ones; a prompt whose snapshots were evicted runs cold
    again (its KV blocks alone are not a hit)."""
    engine = make_qwen3_5_engine(num_state_snapshots=2, state_snapshot_interval=1)
    first = ask("what is in the picture?")
    _check(engine, qwen3_5_oracle, first, qwen_images[:1], "a")
    text = USER + "describe a red car on the table, then a blue one beside it, and say which is faster" + END
    _check(engine, qwen3_5_oracle, text, [], "b")
    stats = engine.stats()
    assert stats.state_snapshots_held == 2 and stats.state_snapshot_evictions == 2
    again = _check(engine, qwen3_5_oracle, first, qwen_images[:1], "a2")
    assert again.cached_prompt_tokens == 0 and engine.stats().state_snapshot_hits == 0
    assert engine.stats().kv_blocks_cached_free > 0  # its KV was still cached: the snapshot decided


def test_a_short_pool_keeps_the_most_useful_snapshots(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    """Two slots and a snapshot every block: the prompt's one step wants many, and the two it keeps are its
    last block boundary and the image's, not its first two; so the same prompt again resumes at its last
    block, and a new question about the image at the image's end."""
    engine = make_qwen3_5_engine(num_state_snapshots=2, state_snapshot_interval=1)
    prompt = ask("what is in the picture? answer in one long sentence about every object you see")
    _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "cold")
    assert engine.stats().state_snapshots_held == 2
    warm = _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "warm")
    assert warm.cached_prompt_tokens == (warm.prompt_tokens - 1) // 16 * 16
    other = _check(engine, qwen3_5_oracle, ask("which colours are there?"), qwen_images[:1], "other")
    assert 0 < other.cached_prompt_tokens < warm.cached_prompt_tokens  # the image's end


def test_no_reuse_without_snapshots(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    engine = make_qwen3_5_engine(num_state_snapshots=0)
    prompt = ask("what is in the picture?")
    _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "cold")
    warm = _check(engine, qwen3_5_oracle, prompt, qwen_images[:1], "warm")
    stats = engine.stats()
    assert warm.cached_prompt_tokens == 0 and stats.state_snapshots_taken == 0
    assert stats.kv_blocks_cached_free == 0  # prefix caching is off for the model


def _bytes_per_snapshot(engine) -> int:
    from decoder_svc.model.linear_state import LinearStatePool

    return LinearStatePool.bytes_per_slot(engine.model_config, engine.dtype)
