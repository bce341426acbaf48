"""The full warm-up (engine/warm_up.py) on Phi-4-multimodal: its built-in vision adapter's LoRA path runs
too (a third prompt in the first step under the first served adapter), and nothing is left after it."""

from __future__ import annotations

from tests.family_fixtures import engine_factory


def test_the_warm_up_runs_the_vision_adapter_and_leaves_nothing(phi4_tiny_dir):
    from decoder_svc.engine.warm_up import warm_up, warm_up_batches

    engine = engine_factory(phi4_tiny_dir)()
    first, follow_up = warm_up_batches(engine)
    assert [p.lora_adapter for p in first] == ["", "", engine.config.served_adapters[0]]
    assert engine.config.served_adapters[0] == "vision" and len(follow_up) == 1
    slots = []
    launch = engine.runner.execute

    def recorded(batch):
        slots.append({s.lora_slot for s in batch.sequences})
        return launch(batch)

    engine.runner.execute = recorded
    warm_up(engine, full=True)
    assert any(len(s) == 2 for s in slots), "a step with rows of the base model and of the adapter"
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.kv_blocks_cached_free, stats.prefix_cache_queried_tokens) == (0, 0, 0)
