"""The full warm-up on a hybrid stack (engine/warm_up.py) runs its linear layers' paths: two sequences in one
chunked call, a snapshot read from the chunk states, a follow-up resumed from a snapshot; then no snapshot
is left (tests/engine/test_warm_up.py: a user's request is computed as on a fresh engine)."""

from __future__ import annotations

from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.warm_up import warm_up, warm_up_batches
from tests.qwen3_5.linear_steps import INTERPRETED

pytestmark = INTERPRETED


def test_a_hybrid_warm_up_takes_and_resumes_snapshots_then_forgets_them(fake_fla_graphs, make_qwen3_5_engine):
    small = {"num_kv_blocks": 64, "state_snapshot_interval": 8}  # prompts of 341 and 170 tokens (fewer to
    engine = make_qwen3_5_engine(**small)                           # interpret), snapshots every 128
    seen = []
    reset_stats = engine.reset_stats

    def counted_then_reset():
        seen.append((engine.blocks.snapshots.counters.hits, engine.blocks.snapshots.counters.taken))
        reset_stats()

    engine.reset_stats = counted_then_reset
    warm_up(engine, full=True)
    assert any(n == 2 for n in fake_fla_graphs.chunk_calls), "both prompts in one chunked call"
    assert fake_fla_graphs.state_calls, "a snapshot read from the chunk states"
    hits, taken = seen[0]
    assert hits == 1 and taken >= 3, "the follow-up resumed from the long prompt's snapshot"
    stats = engine.stats()
    assert (stats.state_snapshots_held, stats.state_slots_used, stats.kv_blocks_cached_free) == (0, 0, 0)
    assert stats.state_snapshot_hits == stats.state_snapshots_taken == 0

    prompt = warm_up_batches(engine)[1][0].token_ids  # the follow-up: its prefix is no longer cached
    out = engine.generate("user", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2))
    assert out.usage.cached_prompt_tokens == 0 and len(out.new_token_ids) == 2
