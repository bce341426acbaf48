"""Qwen3.5's hybrid stack on a CUDA device (fp32): decode steps replay real CUDA graphs whose state slots
are an input buffer, pad rows on a slot of their own, and the tokens equal HF's generate; a follow-up
resumed from a snapshot decodes in graphs too. (The CPU tests run the same path through an emulation:
tests/qwen3_5/test_decode_graphs.py.)"""

from __future__ import annotations

from pathlib import Path

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, TWO

N = 12


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          **{"max_num_batched_tokens": 64, "max_num_seqs": 6, **overrides})
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def test_decode_graphs_equal_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    engine = _engine(qwen3_5_model_dir)
    assert engine.runner.uses_cuda_graphs and engine.runner.graphs.mixed_sizes == []
    small = qwen_images[0]
    plan = {"text": (TEXT, [], N), "one": (ONE, [small], N - 4), "two": (TWO, [small, small], N + 3)}
    for rid, (prompt, imgs, n) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(n))
    results = run_all(engine)
    for rid, (prompt, imgs, n) in plan.items():
        assert results[rid]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, n), rid
    assert engine.runner.graph_steps > 0
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_a_snapshot_resume_then_graph_decode_equals_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    engine = _engine(qwen3_5_model_dir, max_num_seqs=2)
    ref = qwen3_5_oracle.generate(ONE, [qwen_images[0]], N)
    assert engine.generate("a", ONE, [qwen_images[0]], sampling=greedy(N)).new_token_ids == ref
    again = engine.generate("b", ONE, [qwen_images[0]], sampling=greedy(N))
    assert again.new_token_ids == ref and again.usage.cached_prompt_tokens > 0
    assert engine.runner.graph_steps > 0
