"""Gemma 3's sliding-window layers keep only their window's KV blocks, and generation still equals HF's
(fp32 greedy, CPU, gemma-3-tiny: a 16-token window on five of six layers). 4-token blocks, so a prompt
spans many windows and the window drops blocks within and between chunks; with synchronous and
asynchronous scheduling; prefix hits, preemption under a tiny budget, concurrent requests, an image."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sliding_block_manager import SlidingWindowBlockManager
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_text_model import PROMPT
from tests.oracle import greedy, run_all

N = 12
BS = 4
WINDOW = 16  # gemma-3-tiny's
LONG = PROMPT.replace("<end_of_turn>", ", then back home through the hills, the town and the forest, "
                                       "where an owl watches it pass<end_of_turn>")
SHARED = PROMPT.replace("<end_of_turn>", " and the old bridge<end_of_turn>")
PROMPTS = (PROMPT, LONG, SHARED)


@pytest.fixture(scope="module")
def want(gemma3_oracle) -> dict[str, list[int]]:
    """HF's greedy tokens for each prompt."""
    return {p: gemma3_oracle.generate(p, [], N) for p in PROMPTS}


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def make_engine(gemma3_tiny_dir: Path, request: pytest.FixtureRequest):
    """Engines on gemma-3-tiny with 4-token blocks, synchronous and asynchronous scheduling."""

    def make(**overrides) -> LLMEngine:
        cfg = dict(model=gemma3_tiny_dir, num_kv_blocks=256, max_num_batched_tokens=2048, block_size=BS,
                   max_num_seqs=4, async_scheduling=request.param)
        cfg.update(overrides)
        config = EngineConfig(**cfg)
        return LLMEngine(config, LocalEmbeddingSource.for_engine(config))

    return make


def sliding_pool(engine: LLMEngine) -> SlidingWindowBlockManager:
    (pool,) = [p for p in engine.blocks.pools if isinstance(p, SlidingWindowBlockManager)]
    return pool


def held_bound(chunk: int) -> int:
    """The most sliding blocks a request holds with chunks of at most `chunk` tokens."""
    return -(-(WINDOW + chunk) // BS) + 2


def run_checking_bounds(engine: LLMEngine, chunk: int) -> dict:
    """run_all, asserting after every step that each running request holds at most its window (plus a
    chunk) of sliding blocks, and that a long one holds fewer than in the full group."""
    results: dict = {}
    shrunk = False
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, dict(tokens=[]))
            r["tokens"] += out.new_token_ids
            if out.finished:
                r.update(finish=out.finish_reason, usage=out.usage, error=out.error)
        for req in engine.scheduler.running:
            full, sliding = engine.blocks.num_held_blocks(req)
            assert sliding <= held_bound(chunk), (req.request_id, full, sliding)
            shrunk |= sliding < full
    assert shrunk
    return results


def assert_nothing_held(engine: LLMEngine) -> None:
    """Zero used blocks in every group."""
    assert engine.stats().kv_blocks_used == 0
    assert all(s.used_blocks == 0 for s in engine.blocks.group_stats())


def test_two_groups_and_a_smaller_sliding_pool(make_engine) -> None:
    """The tiny model has a full and a sliding group; the sliding pool is sized by the window and the
    largest chunk (the budget plus one whole 16-token image, which may run over it)."""
    engine = make_engine(max_num_batched_tokens=8)
    groups = engine.kv_spec.groups
    assert [g.window for g in groups] == [None, WINDOW]
    assert groups[1].num_blocks == 4 * held_bound(8 + 16) < groups[0].num_blocks
    assert [len(g.layers) for g in groups] == [1, 5]
    assert engine.runner.kv_caches[0].shape[1] == groups[1].num_blocks + 1  # a sliding layer: + null block


@pytest.mark.parametrize("budget", [2048, 7, 5])
def test_long_prompts_equal_hf(make_engine, want, budget: int) -> None:
    """Whole prefill, and chunks of 7 or 5 tokens (the window drops blocks within and between chunks)."""
    engine = make_engine(max_num_batched_tokens=budget)
    for i, prompt in enumerate((PROMPT, LONG)):
        engine.add_request(f"r{i}", prompt, sampling=greedy(N))
        results = run_checking_bounds(engine, budget)
        assert not results[f"r{i}"]["error"]
        assert results[f"r{i}"]["tokens"] == want[prompt], budget
    assert_nothing_held(engine)


@pytest.mark.parametrize("budget", [2048, 9])
def test_prefix_hits_equal_hf(make_engine, want, budget: int) -> None:
    """A repeat hits all but its last block; a shared-prefix prompt hits the shared blocks (its window's
    sliding blocks were cached while the first request held them)."""
    engine = make_engine(max_num_batched_tokens=budget)
    cold = engine.generate("cold", LONG, sampling=greedy(N))
    warm = engine.generate("warm", LONG, sampling=greedy(N))
    shared = engine.generate("shared", SHARED, sampling=greedy(N))
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // BS * BS
    assert shared.usage.cached_prompt_tokens > WINDOW
    assert cold.new_token_ids == warm.new_token_ids == want[LONG]
    assert shared.new_token_ids == want[SHARED]
    hits = warm.usage.cached_prompt_tokens + shared.usage.cached_prompt_tokens
    assert engine.stats().prefix_cache_hit_tokens == hits
    assert_nothing_held(engine)


def test_hit_after_the_window_dropped_the_prefix_blocks(make_engine, want) -> None:
    """Small chunks: the first request frees its early sliding blocks as it goes. Those that no other
    request took are still cached, so the repeat hits; the output is HF's either way."""
    engine = make_engine(max_num_batched_tokens=6)
    engine.generate("a", LONG, sampling=greedy(N))
    pool = sliding_pool(engine)
    assert pool.stats().cached_free_blocks > 0
    again = engine.generate("b", LONG, sampling=greedy(N))
    assert again.usage.cached_prompt_tokens > WINDOW
    assert again.new_token_ids == want[LONG]
    assert_nothing_held(engine)


def test_preemption_under_a_tiny_budget_and_concurrent_requests(make_engine, want) -> None:
    engine = make_engine(num_kv_blocks=40, max_num_batched_tokens=8, max_num_seqs=4)
    plan = {f"r{i}": PROMPTS[i % 3] for i in range(6)}
    for rid, prompt in plan.items():
        engine.add_request(rid, prompt, sampling=greedy(N))
    results = run_checking_bounds(engine, 8)
    assert engine.stats().preemptions > 0
    for rid, prompt in plan.items():
        assert results[rid]["tokens"] == want[prompt], rid
    assert_nothing_held(engine)


def test_abort_frees_every_group(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("a", LONG, sampling=greedy(50))
    engine.add_request("b", PROMPT, sampling=greedy(50))
    for _ in range(12):
        engine.step()
    assert all(n > 0 for n in engine.blocks.num_held_blocks(engine.scheduler.get("a")))
    engine.abort("a")
    engine.abort("b")
    run_all(engine)
    assert_nothing_held(engine)


def test_image_with_small_blocks_equals_hf(make_engine, gemma3_oracle) -> None:
    """An image (16 bidirectional tokens) inside a prompt longer than the window, in small chunks."""
    prompt = LONG.replace("write a long story", "look at <start_of_image> and write a long story")
    image = sample_images()[0]
    engine = make_engine(max_num_batched_tokens=7)
    out = engine.generate("img", prompt, [image], sampling=greedy(N))
    assert not out.error
    assert out.new_token_ids == gemma3_oracle.generate(prompt, [image], N)
    assert_nothing_held(engine)


def test_graph_shaped_steps_equal_hf(make_engine, want, monkeypatch) -> None:
    """Steps through the CUDA-graph path (emulated on CPU: tests/engine/test_graph_shapes.py), with each
    group's static slots and tables and the graphs' padding rows."""
    from decoder_svc.runner import model_runner
    from tests.engine.test_graph_shapes import EmulatedGraphs

    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    engine = make_engine(max_num_batched_tokens=7)
    engine.add_request("a", LONG, sampling=greedy(N))
    engine.add_request("b", PROMPT, sampling=greedy(N))
    results = run_checking_bounds(engine, 7)
    assert {k.decode for k in engine.runner.graphs.replayed} == {True, False}
    assert results["a"]["tokens"] == want[LONG] and results["b"]["tokens"] == want[PROMPT]
    assert_nothing_held(engine)


def test_two_tensor_parallel_ranks_equal_hf(gemma3_tiny_dir: Path, want) -> None:
    """TP=2 (gloo): every rank splits the agreed block count into the same pools; the groups' tables
    travel to the worker with each step."""
    config = EngineConfig(model=gemma3_tiny_dir, num_kv_blocks=256, block_size=BS, max_num_batched_tokens=7,
                          max_num_seqs=4, tensor_parallel_size=2)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    try:
        engine.add_request("a", LONG, sampling=greedy(N))
        engine.add_request("b", PROMPT, sampling=greedy(N))
        results = run_checking_bounds(engine, 7)
        assert results["a"]["tokens"] == want[LONG] and results["b"]["tokens"] == want[PROMPT]
        assert_nothing_held(engine)
    finally:
        engine.close()
