"""Phi-4-MM served with its checkpoint's vision LoRA (the built-in adapter "vision", chosen for requests
with images; text alone runs the base model): fp32 greedy tokens equal HF's model with the adapter merged
into its weights (image requests) or the base model (text), for one image, several of different aspect
ratios, chunks that split images, a prefix hit, and a batch mixing text and image requests through
preemption. KV computed under the adapter is never reused by a base-model request with the same token
prefix. The comparisons can fail: the adapter changes the tokens, and an engine whose layout picks no
adapter for images differs from the oracle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from common.families.phi4mm.layout import Phi4ImageLayout
from common.images import encode_png
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all
from tests.phi4mm.images import sample_images

N = 10
LEAD = "<|user|>the quick brown fox jumps over the lazy dog near the old harbour wall, twice, at dawn "
ONE = (LEAD + "<|image|>what is in the picture?<|end|><|assistant|>", (1,))
MANY = ("<|user|>compare <|image|> with <|image|> and <|image|><|end|><|assistant|>", (1, 3, 0))
TEXT = (LEAD + "what is in the picture?<|end|><|assistant|>", ())
SHORT = ("<|user|>name a colour<|end|><|assistant|>", ())


def _images(idx: tuple[int, ...]) -> list:
    return [sample_images()[i] for i in idx]


@pytest.fixture(scope="module")
def want(phi4_oracle) -> Callable[[tuple, int], list[int]]:
    """The oracle's greedy tokens for a (prompt, image indices) case, memoised."""
    memo: dict = {}

    def tokens(case: tuple, n: int = N) -> list[int]:
        key = (case, n)
        if key not in memo:
            memo[key] = phi4_oracle.generate(case[0], _images(case[1]), n)
        return memo[key]

    return tokens


def make_engine(model: Path, **overrides) -> LLMEngine:
    cfg = dict(model=model, num_kv_blocks=512, max_num_batched_tokens=2048, block_size=16)
    cfg.update(overrides)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def _run(engine: LLMEngine, rid: str, case: tuple, n: int = N):
    files = [encode_png(im) for im in _images(case[1])]
    out = engine.generate(rid, case[0], files, sampling=greedy(n))
    assert out.error is None, out.error
    return out


def test_the_adapter_matters(phi4_oracle, want) -> None:
    """The vision adapter changes image requests' tokens (so serving the base model would fail below), and
    the oracle's outputs vary."""
    for case in (ONE, MANY):
        assert phi4_oracle.generate(case[0], _images(case[1]), N, adapter=None) != want(case)
        assert len(set(want(case))) >= 3, want(case)


@pytest.mark.parametrize("budget", [2048, 100, 37])
def test_image_and_text_requests_equal_the_oracle(phi4_tiny_dir, want, budget) -> None:
    """Whole prefill and chunks that split the images (100 and 37 tokens a step)."""
    engine = make_engine(phi4_tiny_dir, max_num_batched_tokens=budget)
    for i, case in enumerate((ONE, MANY, TEXT)):
        out = _run(engine, f"r{i}", case)
        assert out.new_token_ids == want(case), (budget, i)
        assert out.usage.images == len(case[1])


def test_a_prefix_hit_under_the_adapter(phi4_tiny_dir, want) -> None:
    engine = make_engine(phi4_tiny_dir, max_num_batched_tokens=64)
    cold, warm = _run(engine, "cold", ONE), _run(engine, "warm", ONE)
    assert cold.usage.cached_prompt_tokens == 0
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16 > 400
    assert cold.new_token_ids == warm.new_token_ids == want(ONE)


def test_text_never_reuses_kv_computed_under_the_adapter(phi4_tiny_dir, want) -> None:
    """TEXT and ONE share their first blocks' tokens (LEAD); ONE's KV is the vision adapter's, so TEXT
    reuses none of it; the identical image request and the repeated text each reuse their own."""
    engine = make_engine(phi4_tiny_dir)
    ids = [engine.inputs.make_request(r, c[0], [encode_png(im) for im in _images(c[1])]).prompt_token_ids
           for r, c in (("i", ONE), ("t", TEXT))]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert shared >= 32, "the prompts should share two KV blocks of tokens"
    image = _run(engine, "image", ONE)
    text = _run(engine, "text", TEXT)
    again = _run(engine, "again", ONE)
    text2 = _run(engine, "text2", TEXT)
    assert image.usage.cached_prompt_tokens == 0 and text.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == (again.usage.prompt_tokens - 1) // 16 * 16
    assert text2.usage.cached_prompt_tokens == (text2.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert image.new_token_ids == again.new_token_ids == want(ONE)
    assert text.new_token_ids == text2.new_token_ids == want(TEXT)
    assert engine.stats().prefix_cache_hit_tokens_by_adapter == {
        "vision": again.usage.cached_prompt_tokens, "": text2.usage.cached_prompt_tokens}


def test_mixed_batch_with_preemption(phi4_tiny_dir, want) -> None:
    """Text and image requests prefilled and decoded in shared steps, under too few KV blocks: rows of
    slot 0 and slot 1 side by side, recomputed after preemption under their own adapters."""
    engine = make_engine(phi4_tiny_dir, num_kv_blocks=48, max_num_batched_tokens=64, max_num_seqs=4)
    plan = {"t": TEXT, "i": ONE, "s": SHORT, "m": ((LEAD + "<|image|>and this?<|end|><|assistant|>"), (0,))}
    for rid, case in plan.items():
        engine.add_request(rid, case[0], [encode_png(im) for im in _images(case[1])], sampling=greedy(20))
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, case in plan.items():
        assert results[rid]["tokens"] == want(case, 20), rid
    assert engine.stats().kv_blocks_used == 0


def test_without_the_adapter_an_image_request_differs(phi4_tiny_dir, want, monkeypatch) -> None:
    """The check above can fail: a layout that picks no adapter serves image requests on the base model,
    whose tokens are not the oracle's."""
    monkeypatch.setattr(Phi4ImageLayout, "request_adapter", lambda self, has_images, has_videos: None)
    engine = make_engine(phi4_tiny_dir)
    out = _run(engine, "base", ONE)
    assert out.new_token_ids != want(ONE)
