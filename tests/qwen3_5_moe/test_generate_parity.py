"""Served tokens equal HF Qwen3_5MoeForConditionalGeneration.generate (fp32, greedy) on qwen3.5-moe-tiny:
Qwen3.5's hybrid stack with every MLP a mixture of experts beside a gated shared expert, for text, one and
two images, chunks that cut images, concurrent requests with preemptions, and a follow-up question that
resumes from the state snapshot at its image's end; nothing is left held."""

from __future__ import annotations

import functools

import pytest

from tests.oracle import greedy, run_all
from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION, tokens_equal_hf

N = 8

_check = functools.partial(tokens_equal_hf, n=N)


def _idle(engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and engine.source.num_leases == 0


def test_the_checkpoint_is_a_hybrid_moe_stack_with_shared_experts(make_qwen3_5_moe_engine):
    engine = make_qwen3_5_moe_engine()
    cfg = engine.model_config
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert all(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 48)
    assert cfg.shared_expert_intermediate_size == 40
    mlp = engine.model.layers[0].mlp
    assert mlp.shared_expert.gate_up_proj.weight.shape == (80, 64)
    assert mlp.experts.gate_up_proj.shape == (8, 96, 64)


def test_text_and_images(make_qwen3_5_moe_engine, qwen3_5_moe_oracle, qwen_images):
    engine = make_qwen3_5_moe_engine()
    _check(engine, qwen3_5_moe_oracle, TEXT, [], rid="text")
    assert _check(engine, qwen3_5_moe_oracle, ONE, qwen_images[:1], rid="one").usage.images == 1
    assert _check(engine, qwen3_5_moe_oracle, TWO, qwen_images[::2], rid="two").usage.images == 2
    _idle(engine)


@pytest.mark.parametrize("budget", [7, 13])
def test_chunks_that_cut_images(make_qwen3_5_moe_engine, qwen3_5_moe_oracle, qwen_images, budget):
    engine = make_qwen3_5_moe_engine(max_num_batched_tokens=budget)
    _check(engine, qwen3_5_moe_oracle, TWO, [qwen_images[0]] * 2, rid="two")
    _idle(engine)


def test_concurrent_requests_with_preemption(make_qwen3_5_moe_engine, qwen3_5_moe_oracle, qwen_images):
    engine = make_qwen3_5_moe_engine(max_num_batched_tokens=96, num_kv_blocks=20, max_num_seqs=4,
                                     num_state_snapshots=0)
    small = qwen_images[0]
    plan = [(TEXT, []), (ONE, [small]), (TWO, [small, small]), (ONE, [small])]
    for i, (prompt, imgs) in enumerate(plan):
        engine.add_request(f"c{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for i, (prompt, imgs) in enumerate(plan):
        assert results[f"c{i}"]["tokens"] == qwen3_5_moe_oracle.generate(prompt, imgs, N), f"request c{i}"
    assert engine.stats().preemptions > 0
    _idle(engine)


def test_a_follow_up_resumes_from_the_snapshot_at_the_image(make_qwen3_5_moe_engine, qwen3_5_moe_oracle,
                                                            qwen_images):
    engine = make_qwen3_5_moe_engine()
    image = qwen_images[:1]
    _check(engine, qwen3_5_moe_oracle, USER + VISION + "describe every shape in it" + END, image, rid="first")
    follow = _check(engine, qwen3_5_moe_oracle, USER + VISION + "which colour is the largest?" + END, image,
                    rid="follow-up")
    assert follow.usage.cached_prompt_tokens > 0 and engine.stats().state_snapshot_hits == 1
    _idle(engine)
