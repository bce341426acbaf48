"""Phi-4-multimodal on CUDA (phi-4-mm-tiny, fp32): the vision adapter through the Triton LoRA kernels (few
rows) and the stacked GEMMs (a prefill chunk of more than 64 rows), CUDA graphs captured with and without
the LoRA product, text and image requests in the same steps, against HF on the CPU (the oracle: the base
model for text, the vision adapter merged for images); the HD transform on the device within the
encoder's pixel_tolerance of the host's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.phi4mm.conftest as phi4_fixtures
from common.families.phi4mm.encoder import Phi4VisionEncoder
from common.families.phi4mm.pixels import hd_transform, hd_transform_uint8, to_rgb_uint8
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


def test_cuda_image_requests_alone_replay_the_merged_graphs(phi4_tiny_dir, phi4_oracle):
    """Image requests one at a time: every step on the vision adapter's merged weights (decode steps in
    the merged graph set), HF's tokens; text then on the base graphs (decoder_svc/model/lora/merged.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = _engine(phi4_tiny_dir)
    runner = engine.runner
    assert any(k.merged for k in runner.graphs._graphs)
    images = sample_images()
    for rid, (prompt, idx) in CASES.items():
        imgs = [images[i] for i in idx]
        out = engine.generate(rid, prompt, imgs, sampling=greedy(N))
        assert out.new_token_ids == phi4_oracle.generate(prompt, imgs, N), rid
    assert runner.lora_steps == 0 and runner.merged_steps >= len(CASES) * N and runner.graph_steps > 0
    assert engine.generate("t", TEXT, sampling=greedy(N)).new_token_ids == phi4_oracle.generate(TEXT, [], N)
    assert runner.lora_steps == 0


def test_cuda_device_preprocessing_within_tolerance(phi4_tiny_dir):
    encoder = Phi4VisionEncoder(phi4_tiny_dir, device="cuda", dtype=torch.bfloat16)
    assert encoder.preprocess_mode == "torch"
    settings = encoder.layout.settings
    worst = 0.0
    for image in sample_images():
        host = hd_transform(image, settings)
        dev = hd_transform_uint8(to_rgb_uint8(image).cuda(), settings)
        assert (dev.num_tokens, dev.grid, dev.image_size) == (host.num_tokens, host.grid, host.image_size)
        assert torch.equal(dev.attention_mask.cpu(), host.attention_mask)
        worst = max(worst, (dev.pixel_values.cpu() - host.pixel_values).abs().max().item())
    assert worst <= encoder.pixel_tolerance, worst
    images = sample_images()[:2]
    feats = encoder.encode(images)
    assert [f.shape[0] for f in feats] == [encoder.layout.tokens_for_size(*im.size) for im in images]
