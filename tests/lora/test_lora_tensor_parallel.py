"""Adapters under tensor parallelism (CPU, gloo): sharded as the base weights, TP=2 gives the tokens of
HF's model on the merged weights, for a batch that mixes the base model and two adapters, through chunks
and preemption, on LLaVA and on Qwen2.5-VL (one KV head per rank)."""

from __future__ import annotations

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.lora.test_lora_engine import MID, TEXT
from tests.oracle import greedy, run_all

N = 10


def _serve(model_dir, tp, lora_modules, plan, **overrides):
    cfg = EngineConfig(model=model_dir, num_kv_blocks=24, max_num_batched_tokens=13, max_num_seqs=4,
                       tensor_parallel_size=tp, lora_modules=lora_modules, **overrides)
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))
    try:
        for rid, (adapter, prompt) in plan.items():
            engine.add_request(rid, prompt, sampling=greedy(N), lora_adapter=adapter)
        results = run_all(engine)
        assert all(r["error"] is None for r in results.values())
        return {rid: r["tokens"] for rid, r in results.items()}, engine
    finally:
        engine.close()


def test_two_ranks_equal_merged_weights(tiny_model_dir, lora_dirs, merged_oracles):
    plan = {"b": ("", TEXT), "x": ("a1", MID), "y": ("a2", TEXT), "z": ("a1", TEXT)}
    tokens, engine = _serve(tiny_model_dir, 2, {n: str(p) for n, p in lora_dirs.items()}, plan)
    assert engine.model.tp is not None
    for rid, (adapter, prompt) in plan.items():
        merged_oracles[adapter].assert_same_tokens(tokens[rid], prompt, [], N)


def test_qwen_two_ranks_give_one_ranks_tokens(qwen_model_dir, tmp_path):
    from tests.lora.adapters import write_adapter
    from tests.lora.test_lora_qwen import TEXT as QWEN_TEXT

    adapter = write_adapter(qwen_model_dir, tmp_path / "q", seed=7, targets=("k_proj", "v_proj", "o_proj",
                                                                              "up_proj", "down_proj"))
    plan = {"b": ("", QWEN_TEXT), "q": ("q", QWEN_TEXT)}
    single, _ = _serve(qwen_model_dir, 1, {"q": str(adapter)}, plan)
    split, _ = _serve(qwen_model_dir, 2, {"q": str(adapter)}, plan)
    assert split == single and single["q"] != single["b"]
