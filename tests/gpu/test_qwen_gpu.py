"""Qwen2.5-VL on a CUDA device: the engine's Triton kernels and CUDA graphs (fp32) give HF's tokens, the
device-side image processor stays within its tolerance, and the bf16 tower is close to HF's."""

from __future__ import annotations

import pytest
import torch

from common.families.qwen2_5_vl.encoder import QwenVisionEncoder
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all
from tests.qwen.test_parity import ONE, TEXT, THREE

N = 12


@pytest.mark.parametrize("budget", [13, 2048])
def test_engine_on_cuda_equals_hf(qwen_model_dir, qwen_oracle, qwen_images, budget):
    config = EngineConfig(model=qwen_model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          max_num_batched_tokens=budget)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    plan = {"text": (TEXT, []), "one": (ONE, qwen_images[:1]), "three": (THREE, qwen_images)}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == qwen_oracle.generate(prompt, imgs, N), rid
    assert engine.runner.graph_steps > 0  # decode steps replayed CUDA graphs (one position row)
    assert engine.stats().kv_blocks_used == 0


def test_device_pixels_and_bf16_tower(qwen_model_dir, qwen_oracle, qwen_images):
    hf = QwenVisionEncoder(qwen_model_dir, preprocess="hf")
    dev = QwenVisionEncoder(qwen_model_dir, "cuda", torch.bfloat16)
    assert dev.preprocess_mode == "torch"
    for image in qwen_images:
        ref, ours = hf.prepare(image), dev.prepare(image)
        diff = (dev._rows(ours).cpu() - ref.pixel_values).abs()
        assert diff.max().item() <= dev.pixel_tolerance
    refs = qwen_oracle.image_features(qwen_images)
    for mine, ref in zip(dev.encode(qwen_images), refs, strict=True):
        rel = (mine.float().cpu() - ref).norm() / ref.norm()
        assert rel < 0.05, f"bf16 tower relative error {rel:.4f}"
