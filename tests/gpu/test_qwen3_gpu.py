"""Qwen3-VL on a CUDA device: the engine's Triton kernels and CUDA graphs (fp32) give HF's tokens (text,
one image, three images, chunk budgets 13 and 2048; also with the tower's compiled elementwise steps),
the device-side image processor stays within its tolerance, and the bf16 tower with the GPU fast path
(patch embedding as one matrix product, compiled rotary / LayerNorms / residual adds) is close to HF's.

The fixtures of tests/qwen3/conftest.py are not visible from tests/gpu: the tiny checkpoint and the oracle
are made here the same way (MMSERVE_TEST_MODEL_CACHE is honoured, as there).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, run_all
from tests.qwen3.test_generate_parity import ONE, TEXT, THREE

N = 12
# Relative error (Frobenius norm, per part: the merged features and each DeepStack level) of our bf16 tower
# against HF's bf16 tower on the same pixels, and against HF's fp32 tower. Measured on a CPU with the tiny
# checkpoint: ~0.008 against HF bf16 (eager and compiled alike), ~0.010 against fp32 (HF's own bf16 tower
# is ~0.010 from its fp32 one).
BF16_VS_HF_BF16 = 0.03
BF16_VS_FP32 = 0.05


def _engine(model_dir: Path, budget: int) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          max_num_batched_tokens=budget)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def _check_plan(engine: LLMEngine, oracle, images: list) -> None:
    plan = {"text": (TEXT, []), "one": (ONE, images[:1]), "three": (THREE, images)}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == oracle.generate(prompt, imgs, N), rid
    assert engine.runner.graph_steps > 0  # decode steps replayed CUDA graphs
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("budget", [13, 2048])
def test_engine_on_cuda_equals_hf(qwen3_model_dir, qwen3_oracle, qwen_images, budget):
    _check_plan(_engine(qwen3_model_dir, budget), qwen3_oracle, qwen_images)


def test_engine_with_compiled_tower_equals_hf(qwen3_model_dir, qwen3_oracle, qwen_images):
    """The in-process tower with its elementwise steps compiled (the encoder service's path on CUDA):
    fp32 rows within ~1e-6 of HF's, the same greedy tokens."""
    engine = _engine(qwen3_model_dir, 2048)
    assert engine.source.encoder.compile_elementwise()
    _check_plan(engine, qwen3_oracle, qwen_images)


def test_device_pixels_and_bf16_tower(qwen3_model_dir, qwen3_oracle, qwen_images):
    from transformers import Qwen3VLForConditionalGeneration

    from common.families.qwen3_vl.encoder import Qwen3VisionEncoder

    hf = Qwen3VisionEncoder(qwen3_model_dir, preprocess="hf")
    dev = Qwen3VisionEncoder(qwen3_model_dir, "cuda", torch.bfloat16)
    assert dev.preprocess_mode == "torch"
    for image in qwen_images:
        ref, ours = hf.prepare(image), dev.prepare(image)
        diff = (dev._rows(ours).cpu() - ref.pixel_values).abs()
        assert diff.max().item() <= dev.pixel_tolerance
    assert dev.compile_elementwise()  # the compiled steps (slower on the H200, so not the default)
    assert all(b.ops.__name__ == "CompiledQwen3VisionOps" for b in dev.tower.blocks)
    pixel_values, grids = qwen3_oracle.pixels(qwen_images)
    refs = qwen3_oracle.image_features(pixel_values, grids)  # fp32, CPU
    hf16 = copy.copy(qwen3_oracle)  # the same oracle code over HF's model in bf16 on the GPU
    hf16.model = Qwen3VLForConditionalGeneration.from_pretrained(
        qwen3_model_dir, dtype=torch.bfloat16).to("cuda").eval()
    refs16 = hf16.image_features(pixel_values.to("cuda", torch.bfloat16), grids.to("cuda"))
    # The same HF pixels through our tower (the device-side processor's differences left out).
    with torch.inference_mode():
        mine = dev.tower(pixel_values.to("cuda", torch.bfloat16), [tuple(g) for g in grids.tolist()])
    ours = mine.split([dev.layout.num_tokens(g) for g in grids.tolist()])  # [parts, rows_i, hidden] each
    for k, (o, r16, r32) in enumerate(zip(ours, refs16, refs, strict=True)):
        assert o.shape == r16.shape == r32.shape
        for part in range(o.shape[0]):
            a, b16, b32 = o[part].float().cpu(), r16[part].float().cpu(), r32[part]
            rel16 = ((a - b16).norm() / b16.norm()).item()
            rel32 = ((a - b32).norm() / b32.norm()).item()
            assert rel16 < BF16_VS_HF_BF16, f"image {k} part {part}: {rel16:.4f} from HF's bf16 tower"
            assert rel32 < BF16_VS_FP32, f"image {k} part {part}: {rel32:.4f} from HF's fp32 tower"
    # And end to end through the device-side processor: still close to HF's fp32 features.
    for k, (o, r32) in enumerate(zip(dev.encode(qwen_images), refs, strict=True)):
        rel = ((o.float().cpu() - r32).norm() / r32.norm()).item()
        assert rel < BF16_VS_FP32, f"image {k}: device-processed bf16 tower relative error {rel:.4f}"
