"""Greedy text-only generation through the in-process engine equals HF's Phi4MultimodalForCausalLM.generate
(fp32, CPU) on phi-4-mm-tiny (partial rotary 0.75, LongRoPE, tied embeddings): whole prefill and prefill in
chunks that split the prompt, prefix-cache hits, and requests decoding in one batch.

The engine serves the checkpoint with its vision LoRA attached (a built-in adapter), and a text request
runs the base model, as HF's class (no LoRA modules) does: the oracle's `base` model. The embedding
source is never asked (text requests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from tests.fakes import FakeSource
from tests.oracle import greedy, run_all

N = 16
PROMPTS = (
    "<|user|>write a long story about a red car that drives along the coast at night, past the lighthouse "
    "and the harbour<|end|><|assistant|>",
    "<|system|>you are terse<|end|><|user|>list three colours of boats at dawn<|end|><|assistant|>",
    "the quick brown fox jumps over the lazy dog, again and again",
)


@pytest.fixture(scope="module")
def want(phi4_oracle) -> dict[str, list[int]]:
    """HF's greedy tokens for each prompt."""
    return {p: phi4_oracle.generate(p, [], N) for p in PROMPTS}


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=model_dir, num_kv_blocks=64, max_num_batched_tokens=2048, block_size=16)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), FakeSource(hidden=64))


def test_hf_is_the_base_model_and_varied(want, phi4_oracle) -> None:
    """The comparison means something: no adapter can be active in HF's text mode, and its greedy output
    is N tokens, not one repeated, after prompts of several KV blocks."""
    assert not any("lora" in name.lower() for name, _ in phi4_oracle.model.named_modules())
    for tokens in want.values():
        assert len(tokens) == N and len(set(tokens)) >= 6, tokens
    assert phi4_oracle.inputs(PROMPTS[0], [])["input_ids"].shape[1] > 2 * 16


@pytest.mark.parametrize("budget", [2048, 7])
def test_greedy_equals_hf(phi4_tiny_dir: Path, want, budget: int) -> None:
    """Whole prefill, and prefill in 7-token chunks."""
    engine = make_engine(phi4_tiny_dir, max_num_batched_tokens=budget)
    for i, prompt in enumerate(PROMPTS):
        out = engine.generate(f"r{i}", prompt, sampling=greedy(N))
        assert not out.error
        assert out.new_token_ids == want[prompt], i


def test_prefix_cache_hit_equals_hf(phi4_tiny_dir: Path, want) -> None:
    engine = make_engine(phi4_tiny_dir, max_num_batched_tokens=13)
    prompt = PROMPTS[0]
    cold = engine.generate("cold", prompt, sampling=greedy(N))
    warm = engine.generate("warm", prompt, sampling=greedy(N))
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16 >= 32
    assert cold.new_token_ids == warm.new_token_ids == want[prompt]


def test_batched_requests_equal_hf(phi4_tiny_dir: Path, want) -> None:
    """Three requests prefilled (in chunks) and decoded together."""
    engine = make_engine(phi4_tiny_dir, max_num_batched_tokens=24)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"b{i}", prompt, sampling=greedy(N))
    results = run_all(engine)
    for i, prompt in enumerate(PROMPTS):
        assert results[f"b{i}"]["tokens"] == want[prompt], i


def test_longer_than_original_max_is_refused(phi4_tiny_dir: Path) -> None:
    """LongRoPE is served up to original_max_position_embeddings (4096) only."""
    engine = make_engine(phi4_tiny_dir)
    assert engine.model_config.max_model_len == 4096
    with pytest.raises(ValueError, match="4096"):
        engine.add_request("long", prompt_token_ids=[5] * 4096, sampling=greedy(1))


def test_text_runs_the_base_model_not_the_vision_adapter(phi4_tiny_dir: Path, want, phi4_oracle) -> None:
    """The vision adapter is served (slot 1) and would change a text request's tokens: text runs slot 0."""
    engine = make_engine(phi4_tiny_dir)
    assert engine.lora_slots == {"": 0, "vision": 1}
    prompt = PROMPTS[1]
    assert phi4_oracle.generate(prompt, [], N, adapter="vision") != want[prompt]
    forced = engine.generate("v", prompt, sampling=greedy(N), lora_adapter="vision")
    assert forced.new_token_ids == phi4_oracle.generate(prompt, [], N, adapter="vision")
    assert engine.generate("t", prompt, sampling=greedy(N)).new_token_ids == want[prompt]
