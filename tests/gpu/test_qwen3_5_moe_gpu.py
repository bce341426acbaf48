"""Qwen3.5-MoE on a CUDA device (fp32): the hybrid stack's GPU paths (fla's kernels, the in-place loop, the
decode graphs over the state slots) with every MLP a mixture of experts beside its gated shared expert;
the tokens equal HF's generate with the experts on the reference path (the fused kernel's fp32 products
run in TF32: tests/gpu/test_fused_moe_gpu.py checks it against the reference), a follow-up resumed from
its image's snapshot included."""

from __future__ import annotations

from pathlib import Path

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.warm_up import warm_up
from tests.oracle import greedy, run_all
from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

N = 10


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          **{"max_num_batched_tokens": 64, "max_num_seqs": 4, **overrides})
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def test_tokens_equal_hf_after_the_full_warm_up(qwen3_5_moe_model_dir, qwen3_5_moe_oracle, qwen_images):
    engine = _engine(qwen3_5_moe_model_dir, attention_backend="torch")  # the experts' reference path
    assert not engine.model.layers[0].mlp.fused
    warm_up(engine, full=True)
    small = qwen_images[0]
    plan = {"text": (TEXT, []), "one": (ONE, [small]), "two": (TWO, [small, small])}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == qwen3_5_moe_oracle.generate(prompt, imgs, N), rid
    follow_up = USER + VISION + "which colours are there?" + END
    again = engine.generate("b", follow_up, [small], sampling=greedy(N))
    assert again.new_token_ids == qwen3_5_moe_oracle.generate(follow_up, [small], N)
    assert again.usage.cached_prompt_tokens > 0
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_the_fused_experts_serve_every_request(qwen3_5_moe_model_dir, qwen_images):
    """The default kernels (fused experts, Triton attention, graphs): every request finishes, nothing
    leaks, and the first tokens agree with the reference path's (TF32 may part them later)."""
    fused = _engine(qwen3_5_moe_model_dir)
    reference = _engine(qwen3_5_moe_model_dir, attention_backend="torch")
    assert fused.model.layers[0].mlp.fused and fused.runner.uses_cuda_graphs
    outs = [e.generate("r", ONE, qwen_images[:1], sampling=greedy(N)).new_token_ids
            for e in (fused, reference)]
    assert len(outs[0]) == N and outs[0][:2] == outs[1][:2]
    assert fused.stats().kv_blocks_used == 0
