"""Served tokens equal HF Qwen3_5ForConditionalGeneration.generate (fp32, greedy) on qwen3.5-tiny: the
hybrid stack (Gated DeltaNet layers over per-request state slots, gated full attention with partial
interleaved M-RoPE) for text, one and two images, chunk sizes that cut images and carry the linear
layers' state across chunks, concurrent requests and preemptions; no state slot leaks."""

from __future__ import annotations

import functools

import pytest

from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, TWO, tokens_equal_hf

N = 8

_check = functools.partial(tokens_equal_hf, n=N)


def _idle(engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and engine.source.num_leases == 0


def test_text_and_images_in_one_chunk(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    engine = make_qwen3_5_engine()
    assert engine.stats().state_slots_total == engine.config.max_num_seqs
    _check(engine, qwen3_5_oracle, TEXT, [], rid="text")
    assert _check(engine, qwen3_5_oracle, ONE, qwen_images[:1], rid="one").usage.images == 1
    out = _check(engine, qwen3_5_oracle, TWO, qwen_images[::2], rid="two")
    assert out.usage.images == 2 and out.usage.cached_prompt_tokens == 0  # shares < 1 block with ONE
    _idle(engine)


@pytest.mark.parametrize("budget", [7, 13])
def test_chunks_that_cut_images_carry_the_state(make_qwen3_5_engine, qwen3_5_oracle, qwen_images, budget):
    """Every chunk continues each linear layer's state from the one before; chunk boundaries inside
    images (the small image twice: few steps)."""
    engine = make_qwen3_5_engine(max_num_batched_tokens=budget)
    _check(engine, qwen3_5_oracle, TWO, [qwen_images[0]] * 2, rid="two")
    _idle(engine)


def test_six_concurrent_requests_with_preemption(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    """Six requests share steps (decodes batched in the recurrent form, prefill chunks beside them); the
    KV pool is too small for all, so some are preempted, free their slot and recompute from zero (no
    snapshots to resume from)."""
    engine = make_qwen3_5_engine(max_num_batched_tokens=96, num_kv_blocks=24, max_num_seqs=6,
                                 num_state_snapshots=0)
    small = qwen_images[0]  # the small image: many requests, few tokens
    plan = [(TEXT, []), (ONE, [small]), (TWO, [small, small]), (ONE, [small]), (TEXT, []), (TWO, [small] * 2)]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"c{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"c{i}"]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, N), f"request c{i}"
    assert engine.stats().preemptions > 0
    _idle(engine)


def test_admission_waits_for_a_free_state_slot(make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    """Two slots for four requests: two run, two wait; each slot is reused once freed, and a request
    ended early (aborted) gives its slot back."""
    engine = make_qwen3_5_engine(num_state_slots=2)
    plan = [(TEXT, []), (ONE, [qwen_images[0]]), (TWO, [qwen_images[0]] * 2), (TEXT, [])]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"s{i}", prompt, imgs, sampling=greedy(N))
    engine.add_request("aborted", TEXT, [], sampling=greedy(N))
    first = engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.state_slots_used, stats.state_slots_total) == (2, 3, 2, 2)
    engine.abort("aborted")
    results = run_all(engine)
    for out in first:  # the first step's tokens
        results[out.request_id]["tokens"][:0] = out.new_token_ids
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"s{i}"]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, N), f"request s{i}"
    _idle(engine)
