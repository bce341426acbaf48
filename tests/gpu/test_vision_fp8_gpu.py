"""The FP8 vision tower on a CUDA device (common/vision/fp8.py): the tensor-core product against the torch
reference, the tiny Qwen towers in FP8 close to their bf16 selves, and CUDA graphs of an FP8 tower."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.vision.encoders import make_vision_encoder
from common.vision.fp8 import Fp8VisionLinear, fp8_linear_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("rows", [1, 77, 4096])
@pytest.mark.parametrize("shape", [(1152, 3456), (4304, 1152), (1280, 6912)])  # Qwen3-VL's, Qwen2.5-VL's
def test_the_tensor_core_product_equals_the_reference(rows, shape):
    torch.manual_seed(0)
    k, n = shape
    linear = nn.Linear(k, n).cuda().to(torch.bfloat16)
    fp8 = Fp8VisionLinear.from_linear(linear)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    got = fp8(x)
    want = fp8_linear_reference(x.float(), fp8.weight, fp8.weight_scale, fp8.bias.float())
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2  # the same quantized operands; bf16 output and accumulation order differ
    assert _rel(got, linear(x)) < 0.08  # and FP8's rounding against the bf16 layer


@pytest.mark.parametrize("family", ["qwen", "qwen3"])
def test_an_fp8_tower_is_close_to_the_bf16_tower_and_graphs_replay_it(family, qwen_model_dir,
                                                                         qwen3_model_dir, qwen_images):
    model_dir = qwen_model_dir if family == "qwen" else qwen3_model_dir
    gpu = make_vision_encoder(model_dir, "cuda", torch.bfloat16, preprocess="hf")
    prepared = [gpu.prepare(image) for image in qwen_images]
    bf16 = gpu.encode_prepared(prepared)
    names = gpu.quantize("fp8")
    assert names and gpu.capture_graphs(8)
    eager = gpu.encode_prepared(prepared)
    for _ in range(3):
        replayed = gpu.encode_prepared(prepared, use_graphs=True)
    assert gpu.graphs.replays == 2
    for o, e, b in zip(replayed, eager, bf16, strict=True):
        assert torch.isfinite(o).all()
        assert _rel(o, e) < 1e-3
        cos = torch.nn.functional.cosine_similarity(o.flatten().float(), b.flatten().float(), dim=0).item()
        print(f"\n{family}: FP8 vs bf16 cosine {cos:.5f}, relative error {_rel(o, b):.4f}")
        assert cos > 0.97  # tiny checkpoints' scaled-up weights; the real shapes' figure: bench.vision_path
