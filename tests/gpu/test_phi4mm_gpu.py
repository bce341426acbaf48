"""Phi-4-multimodal on CUDA (phi-4-mm-tiny, fp32): the vision adapter through the Triton LoRA kernels (few
rows) and the stacked GEMMs (a prefill chunk of more than 64 rows), CUDA graphs captured with and without
the LoRA product, text and image requests in the same steps, against HF on the CPU (the oracle: the base
model for text, the vision adapter merged for images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.phi4mm.conftest as phi4_fixtures
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all
from tests.phi4mm.images import sample_images
from tests.phi4mm.test_image_generate import CASES

pytestmark = pytest.mark.gpu
phi4_tiny_dir = phi4_fixtures.phi4_tiny_dir
phi4_oracle = phi4_fixtures.phi4_oracle
N = 8
TEXT = "<|user|>write a long story about a red car that drives along the coast<|end|><|assistant|>"


def _engine(model_dir: Path, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16)
    cfg.update(kw)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


@pytest.mark.parametrize("budget", [2048, 7])
def test_cuda_text_and_images_in_one_batch(phi4_tiny_dir, phi4_oracle, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = _engine(phi4_tiny_dir, max_num_batched_tokens=budget)
    keys = engine.runner.graphs._graphs
    assert any(k.lora for k in keys) and any(not k.lora for k in keys)
    images = sample_images()
    plan = {"t0": (TEXT, []), "t1": (TEXT[:40] + "<|end|><|assistant|>", [])}
    plan |= {name: (prompt, [images[i] for i in idx]) for name, (prompt, idx) in CASES.items()}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    assert engine.runner.graph_steps > 0
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == phi4_oracle.generate(prompt, imgs, N), rid
    # text alone afterwards: steps without any adapter row (the graphs without the LoRA product)
    out = engine.generate("t2", TEXT, sampling=greedy(N))
    assert out.new_token_ids == phi4_oracle.generate(TEXT, [], N)
    assert engine.stats().kv_blocks_used == 0
