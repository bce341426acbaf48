"""The decoder's warm-up (engine/warm_up.py): the full one runs the step shapes a first cold request and its
follow-up run (an eager prompt off a multiple of 16 beside a second one, then a prefix hit), then leaves the
engine as after start-up: no cached prefix, zero counters, the same tokens for users' requests."""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig
from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.state_snapshots import StateSnapshots
from decoder_svc.engine.warm_up import FOLLOW_UP_TAIL, LONG_PROMPT, WarmUpError, warm_up, warm_up_batches
from tests.engine.test_scheduler_unit import make_request


def wrap_runner(engine, before) -> None:
    """Call before(batch) ahead of every step the engine's runner computes from now on."""
    name = "launch" if engine.async_scheduling else "execute"  # the form the engine calls
    original = getattr(engine.runner, name)

    def wrapped(batch):
        before(batch)
        return original(batch)

    setattr(engine.runner, name, wrapped)


def record_steps(engine) -> list[list[tuple[int, int]]]:
    """(start, tokens) of each sequence of every step the runner computes from now on."""
    steps: list[list[tuple[int, int]]] = []
    wrap_runner(engine, lambda batch: steps.append([(s.start, s.num_tokens) for s in batch.sequences]))
    return steps


def assert_as_after_start(engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached_free == 0
    assert stats.prefix_cache_queried_tokens == 0 and stats.prefix_cache_hit_tokens == 0
    assert engine.blocks.num_free_blocks == engine.kv_spec.num_blocks


def test_the_full_warm_up_runs_a_packed_eager_prompt_and_a_prefix_hit_then_forgets_them(make_engine):
    engine = make_engine()
    steps = record_steps(engine)
    warm_up(engine, full=True)
    long_prompt = len(warm_up_batches(engine)[0][0].token_ids)
    assert 512 < long_prompt <= LONG_PROMPT and long_prompt % 16  # the tiny model's context: 1024 tokens
    prefills = [[n for start, n in step if n > 1] for step in steps]
    # the long prompt, computed eagerly (past the largest mixed graph), beside another
    assert any(len(p) == 2 and max(p) == long_prompt for p in prefills)
    shared = (long_prompt - 1) // 16 * 16
    assert [(shared, FOLLOW_UP_TAIL)] in steps, "the follow-up resumed after the long prompt's blocks"
    assert_as_after_start(engine)
    assert not engine.has_unfinished()


def test_after_the_warm_up_users_requests_equal_hf_and_find_nothing_cached(make_engine, hf_oracle, images):
    engine = make_engine()
    warm_up(engine, full=True)
    long_prompt = warm_up_batches(engine)[0][0].token_ids  # the warm-up's own prompt: no longer cached
    again = engine.generate("again", prompt_token_ids=long_prompt, sampling=SamplingParams(max_tokens=2))
    assert again.usage.cached_prompt_tokens == 0
    prompt = "USER: <image>\nWhat is in this picture? ASSISTANT:"
    out = engine.generate("user", prompt, images[:1], sampling=SamplingParams(max_tokens=8))
    hf_oracle.assert_same_tokens(out.new_token_ids, prompt, images[:1], 8)


def test_a_smaller_cache_scales_the_prompts_down_and_a_tiny_one_gets_the_short_warm_up_only(make_engine):
    engine = make_engine(num_kv_blocks=40)  # 640 tokens: the prompts a third of it
    lengths = [len(p.token_ids) for batch in warm_up_batches(engine) for p in batch]
    assert lengths[0] == 213 and sum(lengths) < 640
    warm_up(engine, full=True)
    assert_as_after_start(engine)
    engine = make_engine(num_kv_blocks=12, default_max_tokens=64)
    assert warm_up_batches(engine) == []
    steps = record_steps(engine)
    warm_up(engine, full=True)
    assert len([s for s in steps if s]) == 2  # the short request's prefill and its second token


def test_a_failing_warm_up_request_fails_the_start(make_engine):
    engine = make_engine()

    def fails_long_steps(batch):
        if any(s.num_tokens > 512 for s in batch.sequences):
            raise RuntimeError("kernel exploded")

    wrap_runner(engine, fails_long_steps)
    with pytest.raises(WarmUpError, match="warm-up-long failed"):
        warm_up(engine, full=True)


def test_full_by_default_on_a_gpu_only(tiny_model_dir):
    def config(**kw):
        return EngineConfig(model=tiny_model_dir, **kw)

    assert not config(device="cpu").full_warm_up
    assert config(device="cpu", warm_up="full").full_warm_up
    assert not config(device="cpu", warm_up="short").full_warm_up


def test_block_manager_reset_leaves_the_pool_as_new_and_refuses_while_blocks_are_held():
    pool = BlockManager(8, block_size=4)
    req = make_request("a", 10)
    assert pool.allocate_slots(req, 10)
    assert not pool.reset_prefix_cache(), "a request holds blocks"
    pool.free(req)
    assert pool.stats().cached_free_blocks == 2
    assert pool.reset_prefix_cache()
    new = BlockManager(8, block_size=4)
    assert pool.stats() == new.stats() and not pool.cached
    assert [pool.free_queue.popleft().block_id for _ in range(8)] == list(range(8))
    assert pool.find_cached_prefix(make_request("b", 10)) == []


def test_snapshots_clear_frees_every_slot_and_refuses_while_one_is_pending():
    snaps = StateSnapshots(3, first_slot=4, interval_blocks=2, bytes_per_snapshot=10)
    first = snaps.reserve(b"a")
    assert not snaps.clear(), "a pending snapshot"
    snaps.promote()
    snaps.reserve(b"b")
    snaps.promote()
    assert snaps.clear()
    assert snaps.num_held == 0 and snaps.lookup(b"a") is None
    assert [snaps.reserve(k) for k in (b"x", b"y", b"z")] == [first, 5, 6]
