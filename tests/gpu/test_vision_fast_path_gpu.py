"""The vision towers' GPU fast path (common/vision/attention.py, common/kernels/vision_fused_ops.py) on a
CUDA device: varlen FlashAttention equals the SDPA reference over mixed spans (head dims 72 and 80, the
Qwen3-VL and Qwen2.5-VL towers'), the Triton steps equal the eager ones in bf16, and both tiny Qwen towers
on their default CUDA path (Triton steps + flash, bf16) stay close to the fp32 CPU tower, which equals
HF's get_image_features exactly (tests/qwen, tests/qwen3)."""

from __future__ import annotations

import pytest
import torch

from common.vision.attention import AttentionSpans, flash_supported
from common.vision.encoders import make_vision_encoder

BF16_VS_FP32 = 0.05  # as tests/gpu/test_qwen3_gpu.py: HF's own bf16 tower is ~0.01 from its fp32 one


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("bounds", [[0, 64, 64, 128, 1353, 1417, 5513],  # an empty span, odd lengths
                                    [0, 4096], [0, 1024, 2048, 3072]])  # uniform: cuDNN or FA2, timed
def test_flash_spans_equal_the_reference(head_dim, bounds):
    from common.vision import attention

    device = torch.device("cuda")
    assert flash_supported(device, torch.bfloat16, head_dim)
    q, k, v = (torch.randn(bounds[-1], 16, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    spans = AttentionSpans.from_bounds(bounds, device, use_flash=True)
    assert spans.uniform == (len(set(b - a for a, b in zip(bounds, bounds[1:], strict=False))) == 1)
    fast = spans.attend(q, k, v, head_dim**-0.5)
    ref = AttentionSpans.from_bounds(bounds, device, use_flash=False).attend(q, k, v, head_dim**-0.5)
    assert torch.isfinite(fast).all()
    assert _rel(fast, ref) < 1e-2
    if spans.uniform:  # both candidates agree, whichever was faster
        dense = attention._dense(q, k, v, len(bounds) - 1, head_dim**-0.5)
        assert _rel(dense, ref) < 1e-2


def test_triton_steps_equal_the_eager_steps_in_bf16():
    from common.families.qwen2_5_vl.tower import VisionOps
    from common.kernels import vision_fused_ops as fused_ops

    torch.manual_seed(0)
    qkv = torch.randn(4900, 3, 16, 80, device="cuda", dtype=torch.bfloat16)
    emb = torch.randn(4900, 40, device="cuda")
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    pairs = zip(fused_ops.rotary_qkv(qkv, cos, sin), VisionOps.rotary_qkv(qkv, cos, sin), strict=True)
    for got, want in pairs:
        assert (got.float() - want.float()).abs().max().item() <= 2 ** -6 * want.float().abs().max().item()
    x, d = (torch.randn(4900, 1280, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(1280, device="cuda", dtype=torch.bfloat16)
    for got, want in zip(fused_ops.add_rms_norm(x, d, w, 1e-6), VisionOps.add_rms_norm(x, d, w, 1e-6),
                         strict=True):
        assert _rel(got, want) < 1e-2
    from common.families.qwen3_vl.tower import Qwen3VisionOps

    b = torch.randn(1280, device="cuda", dtype=torch.bfloat16)
    ln_pairs = zip(fused_ops.add_layer_norm(x, d, w, b, 1e-6),
                   Qwen3VisionOps.add_layer_norm(x, d, w, b, 1e-6),
                   strict=True)
    for got, want in ln_pairs:
        assert _rel(got, want) < 1e-2
    gate_up = torch.randn(4900, 2 * 3456, device="cuda", dtype=torch.bfloat16)
    assert _rel(fused_ops.silu_mul(gate_up), VisionOps.silu_mul(gate_up)) < 1e-2


@pytest.mark.parametrize("family", ["qwen", "qwen3"])
def test_default_cuda_tower_is_close_to_the_fp32_tower(family, qwen_model_dir, qwen3_model_dir, qwen_images):
    model_dir = qwen_model_dir if family == "qwen" else qwen3_model_dir
    cpu = make_vision_encoder(model_dir, "cpu", torch.float32, preprocess="hf")
    gpu = make_vision_encoder(model_dir, "cuda", torch.bfloat16, preprocess="hf")
    assert gpu.fused_ops and gpu.tower.flash_attention
    prepared = [cpu.prepare(image) for image in qwen_images]  # the same HF pixels for both
    refs = cpu.encode_prepared(prepared)
    ours = gpu.encode_prepared(prepared)  # three sizes in one forward: mixed spans
    for k, (o, r) in enumerate(zip(ours, refs, strict=True)):
        assert o.shape == r.shape
        assert _rel(o, r) < BF16_VS_FP32, f"image {k}: {_rel(o, r):.4f}"
    gpu.tower.use_ops(gpu.eager_ops)  # the eager steps and the reference attention agree too
    gpu.tower.flash_attention = False
    for o, e in zip(ours, gpu.encode_prepared(prepared), strict=True):
        assert _rel(o, e) < 0.03


@pytest.mark.parametrize("family", ["qwen", "qwen3"])
def test_graph_replays_equal_the_eager_forward(family, qwen_model_dir, qwen3_model_dir, qwen_images):
    """A batch signature seen twice is captured, then replayed: the same rows as the eager forward."""
    model_dir = qwen_model_dir if family == "qwen" else qwen3_model_dir
    gpu = make_vision_encoder(model_dir, "cuda", torch.bfloat16, preprocess="hf")
    assert gpu.capture_graphs(8)
    prepared = [gpu.prepare(image) for image in qwen_images]
    eager = gpu.encode_prepared(prepared)
    for _ in range(3):
        replayed = gpu.encode_prepared(prepared, use_graphs=True)
    assert gpu.graphs.replays == 2 and len(gpu.graphs.graphs) == 1  # captured at the second sight
    for o, e in zip(replayed, eager, strict=True):
        assert _rel(o, e) < 1e-3
    other = gpu.encode_prepared(prepared[:1], use_graphs=True)  # a new signature: eager until seen twice
    assert gpu.graphs.replays == 2 and _rel(other[0], eager[0]) < 1e-3


def test_captures_share_one_stream_and_do_not_reserve_a_working_set_each(qwen_model_dir, qwen_images):
    """Every capture runs on one side stream: torch's allocator keeps freed blocks per stream, so a new
    stream per capture (torch's pool has 32) left each capture's warm-up activations reserved apart
    (a 96-client H200 soak's encoder grew by gigabytes as new image sizes came). Captured again, the
    same signatures reserve nothing more (a new stream would take a segment of its own, 2 MiB at least)."""
    gpu = make_vision_encoder(qwen_model_dir, "cuda", torch.bfloat16, preprocess="hf")
    assert gpu.capture_graphs(8)
    gpu.graphs.capture_after = 1
    prepared = [gpu.prepare(image) for image in qwen_images]
    streams = set()
    for k in range(len(prepared)):  # a new signature each time: one image, then two, ...
        gpu.encode_prepared(prepared[:k + 1], use_graphs=True)
        streams.add(gpu.graphs.stream)
    assert len(gpu.graphs) == len(prepared) and len(streams) == 1
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for k in range(len(prepared) - 1):  # the last graph stays: the graphs' shared pool lives on
        gpu.graphs.graphs.popitem(last=False)  # the oldest forgotten (the device is idle), captured anew
        gpu.encode_prepared(prepared[:k + 1], use_graphs=True)
        torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - reserved
    print(f"\nreserved: {reserved >> 20} MiB after the first captures, {grown >> 10} KiB more after again")
    assert grown < 2 << 20


def test_the_gelu_epilogue_is_the_tanh_gelu():
    """Qwen3-VL's fc1 + tanh GELU in cuBLASLt's epilogue (FusedQwen3VisionOps) is the tanh form, not the erf
    one (they differ by up to ~3e-4 here, far above fp32's rounding)."""
    from torch import nn

    from common.families.qwen3_vl.tower import linear_gelu_tanh, linear_gelu_tanh_epilogue

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    fc1 = nn.Linear(1152, 4304).cuda()
    x = torch.randn(4096, 1152, device="cuda")
    got = linear_gelu_tanh_epilogue(x, fc1)
    want = linear_gelu_tanh(x, fc1)
    erf = torch.nn.functional.gelu(fc1(x))
    assert (got - want).abs().max().item() < 2e-5
    assert (want - erf).abs().max().item() > 1e-4
    xb, fc1b = x.bfloat16(), fc1.bfloat16()
    assert _rel(linear_gelu_tanh_epilogue(xb, fc1b), linear_gelu_tanh(xb, fc1b)) < 1e-2
