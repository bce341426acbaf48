"""Greedy text-only generation through the in-process engine equals HF's Gemma3ForConditionalGeneration
.generate (fp32, CPU) on gemma-3-tiny: a prompt and output longer than the sliding window, whole or in
small prefill chunks, with prefix-cache hits, and two requests decoding in one batch.

"""

from __future__ import annotations

from pathlib import Path

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.gemma3.test_text_model import PROMPT
from tests.oracle import greedy, run_all

N = 16
OTHER = PROMPT.replace("red car", "blue boat").replace("at night", "at dawn")


@pytest.fixture(scope="module")
def want(gemma3_oracle) -> dict[str, list[int]]:
    """HF's greedy tokens for each prompt."""
    return {p: gemma3_oracle.generate(p, [], N) for p in (PROMPT, OTHER)}


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=model_dir, num_kv_blocks=64, max_num_batched_tokens=2048, block_size=16)
    cfg.update(overrides)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def test_hf_output_is_varied_and_long(want, gemma3_oracle) -> None:
    """The comparison means something: N tokens, not one repeated, after a prompt of > 2 windows."""
    for prompt, tokens in want.items():
        assert len(tokens) == N and len(set(tokens)) >= 5, tokens
        assert gemma3_oracle.inputs(prompt, [])["input_ids"].shape[1] > 2 * 16


@pytest.mark.parametrize("budget", [2048, 7])
def test_greedy_equals_hf(gemma3_tiny_dir: Path, want, budget: int) -> None:
    """Whole prefill, and prefill in 7-token chunks (chunks that straddle the window's edge)."""
    engine = make_engine(gemma3_tiny_dir, max_num_batched_tokens=budget)
    out = engine.generate("r", PROMPT, sampling=greedy(N))
    assert not out.error
    assert out.new_token_ids == want[PROMPT]


def test_prefix_cache_hit_equals_hf(gemma3_tiny_dir: Path, want) -> None:
    engine = make_engine(gemma3_tiny_dir, max_num_batched_tokens=13)
    cold = engine.generate("cold", PROMPT, sampling=greedy(N))
    warm = engine.generate("warm", PROMPT, sampling=greedy(N))
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16 > 16
    assert cold.new_token_ids == warm.new_token_ids == want[PROMPT]


def test_batched_requests_equal_hf(gemma3_tiny_dir: Path, want) -> None:
    """Two requests prefilled and decoded together (the reference's batched decode path)."""
    engine = make_engine(gemma3_tiny_dir, max_num_batched_tokens=24)
    engine.add_request("a", PROMPT, sampling=greedy(N))
    engine.add_request("b", OTHER, sampling=greedy(N))
    results = run_all(engine)
    assert results["a"]["tokens"] == want[PROMPT]
    assert results["b"]["tokens"] == want[OTHER]
