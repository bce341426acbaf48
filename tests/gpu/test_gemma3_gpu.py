"""Gemma 3 on CUDA (gemma-3-tiny, fp32): the Triton attention (sliding windows, image key limits) beside
the torch reference ops, decode CUDA graphs, asynchronous scheduling, against HF on the CPU: tokens and
the first token's top logprobs, whole and in chunks that would cut every image, with preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.gemma3.conftest as gemma3_fixtures
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_image_generate import CASES, TOP, N, assert_same, hf_first_logprobs
from tests.oracle import greedy, run_all

pytestmark = pytest.mark.gpu
# The checkpoint and the oracle are tests/gemma3/conftest.py's fixtures.
gemma3_tiny_dir = gemma3_fixtures.gemma3_tiny_dir
gemma3_oracle = gemma3_fixtures.gemma3_oracle


def _engine(model_dir: Path, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=128, block_size=16)
    cfg.update(kw)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


@pytest.mark.parametrize("budget", [2048, 7])
def test_cuda_parity_with_triton_attention(gemma3_tiny_dir, gemma3_oracle, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = _engine(gemma3_tiny_dir, max_num_batched_tokens=budget)
    assert type(engine.model.backend).__name__ == "TritonAttentionBackend" and engine.async_scheduling
    images = sample_images()
    for name, (prompt, idx) in CASES.items():
        imgs = [images[i] for i in idx]
        out = engine.generate(name, prompt, imgs, sampling=greedy(N, logprobs=TOP))
        assert_same(out, (gemma3_oracle.generate(prompt, imgs, N),
                          hf_first_logprobs(gemma3_oracle, prompt, imgs)), name)
    assert engine.runner.graph_steps > 0 and engine.stats().kv_blocks_used == 0


def test_cuda_concurrent_with_preemption(gemma3_tiny_dir, gemma3_oracle):
    engine = _engine(gemma3_tiny_dir, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=4)
    images = sample_images()
    plan = {}
    for i in range(8):
        prompt, idx = CASES[list(CASES)[i % 3]]
        plan[f"r{i}"] = (prompt, [images[(j + i) % 4] for j in idx])
        engine.add_request(f"r{i}", prompt, plan[f"r{i}"][1], sampling=greedy(N))
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == gemma3_oracle.generate(prompt, imgs, N), rid


@pytest.mark.parametrize("budget", [2048, 7])
def test_cuda_sliding_window_kv_with_small_blocks(gemma3_tiny_dir, gemma3_oracle, budget):
    """4-token blocks: the sliding layers' pool drops blocks as the window moves (real CUDA graphs with
    each group's static tables, Triton reading the null block for tiles across the window's start,
    asynchronous scheduling reusing freed blocks in the next launch)."""
    from tests.gemma3.test_sliding_window_kv import LONG, PROMPT, assert_nothing_held, run_checking_bounds

    torch.backends.cuda.matmul.allow_tf32 = False
    engine = _engine(gemma3_tiny_dir, block_size=4, num_kv_blocks=256, max_num_batched_tokens=budget,
                     max_num_seqs=4)
    assert engine.async_scheduling and len(engine.kv_spec.groups) == 2
    engine.add_request("a", LONG, sampling=greedy(N))
    engine.add_request("b", PROMPT, sampling=greedy(N))
    results = run_checking_bounds(engine, budget)
    assert results["a"]["tokens"] == gemma3_oracle.generate(LONG, [], N)
    assert results["b"]["tokens"] == gemma3_oracle.generate(PROMPT, [], N)
    assert engine.runner.graph_steps > 0
    assert_nothing_held(engine)


def test_cuda_tower_graphs_equal_the_eager_tower_and_hf(gemma3_tiny_dir, gemma3_oracle):
    """The encoder's CUDA graphs of the tower (buckets 1, 2, 4, 5: three images run in bucket 4, padded)
    give the eager tower's rows, and both HF's get_image_features (fp32, on the CPU)."""
    from common.families.gemma3.encoder import Gemma3VisionEncoder

    enc = Gemma3VisionEncoder(gemma3_tiny_dir, "cuda", torch.float32)
    assert enc.capture_graphs(5)
    images = sample_images()[:3]
    prepared = [enc.prepare(img) for img in images]
    graphed = enc.encode_prepared(prepared, use_graphs=True)
    eager = enc.encode_prepared(prepared, use_graphs=False)
    want = gemma3_oracle.image_features(gemma3_oracle.pixels(images))
    for i, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.cpu(), want[i], rtol=1e-4, atol=1e-4)


def test_cuda_torch_preprocessing_is_the_default_in_half_precision(gemma3_tiny_dir, gemma3_oracle):
    """In bf16 on CUDA the encoder resizes and normalises on the device, within its stated tolerance of
    HF's PIL processor; in fp32 it keeps HF's processor (exact)."""
    from common.families.gemma3.encoder import Gemma3VisionEncoder

    assert Gemma3VisionEncoder(gemma3_tiny_dir, "cuda", torch.float32).preprocess_mode == "hf"
    enc = Gemma3VisionEncoder(gemma3_tiny_dir, "cuda", torch.bfloat16)
    assert enc.preprocess_mode == "torch"
    images = sample_images()
    pixels = torch.cat(enc._device_pixels([enc.prepare(img) for img in images])).cpu()
    diff = (pixels - gemma3_oracle.pixels(images)).abs()
    assert diff.max().item() <= enc.pixel_tolerance
    assert diff.mean().item() <= enc.pixel_processor.max_mean_abs_diff()
