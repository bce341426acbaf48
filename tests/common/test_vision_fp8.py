"""The FP8 vision tower (`--vision-quantization fp8`, common/vision/fp8.py) on CPU: the reference math,
which layers are replaced, embeddings close to the full-precision tower's, and the encoder service
serving with it. The GPU kernel against this reference: tests/gpu/test_vision_fp8_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.kernels.fp8_layout import FP8_DTYPE, FP8_MAX
from common.vision.fp8 import Fp8VisionLinear, fp8_linear_reference, quantizable, quantize_tower


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def test_the_reference_quantizes_weights_per_channel_and_activations_per_token():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(10, 64)
    x[3] *= 1000  # one loud token must not coarsen the others' scales
    fp8 = Fp8VisionLinear.from_linear(linear)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.shape == (48, 1)
    # each weight row's largest magnitude maps to FP8's largest value
    assert torch.allclose(fp8.weight.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    got = fp8(x)
    want = linear(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    for row in range(10):  # per token: every row keeps its own relative precision
        err = ((got[row] - want[row]).norm() / want[row].norm()).item()
        assert err < 0.08, (row, err)
    assert not torch.equal(got, want), "the product is FP8's, not the original layer's"
    # the same numbers by hand: q * scale for the weight, and for x
    amax = x.abs().amax(dim=1, keepdim=True)
    xs = amax / FP8_MAX
    xq = (x / xs).to(FP8_DTYPE).float() * xs
    manual = xq @ (fp8.weight.float() * fp8.weight_scale).t() + linear.bias
    torch.testing.assert_close(fp8_linear_reference(x, fp8.weight, fp8.weight_scale, fp8.bias), manual)
    assert fp8(x.view(2, 5, 64)).shape == (2, 5, 48), "leading dims kept"


def test_only_aligned_linear_layers_outside_the_patch_embedding_are_quantized():
    tower = nn.Module()
    tower.patch_embed = nn.Module()
    tower.patch_embed.proj = nn.Linear(32, 32)
    tower.blocks = nn.ModuleList([nn.Module()])
    tower.blocks[0].qkv = nn.Linear(32, 96)
    tower.blocks[0].odd = nn.Linear(32, 70)  # 70 outputs: not a multiple of 16
    tower.merger = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    names = quantize_tower(tower)
    assert names == ["blocks.0.qkv", "merger.0", "merger.2"]
    assert isinstance(tower.merger[0], Fp8VisionLinear) and isinstance(tower.blocks[0].qkv, Fp8VisionLinear)
    assert isinstance(tower.patch_embed.proj, nn.Linear) and isinstance(tower.blocks[0].odd, nn.Linear)
    assert not quantizable("blocks.0.odd", tower.blocks[0].odd)
    with pytest.raises(ValueError, match="no linear layer"):
        quantize_tower(nn.Sequential(nn.GELU()))


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_an_fp8_tower_stays_close_to_the_full_precision_one(family, qwen_model_dir, qwen3_model_dir,
                                                            qwen_images):
    from common.vision.encoders import make_vision_encoder

    model_dir = qwen_model_dir if family == "qwen2.5-vl" else qwen3_model_dir
    encoder = make_vision_encoder(model_dir)
    want = encoder.encode(qwen_images)
    names = encoder.quantize("fp8")
    assert any(".attn.qkv" in n for n in names) and any("merger" in n for n in names)
    assert not any(n.startswith("patch_embed") for n in names)
    got = encoder.encode(qwen_images)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and not torch.equal(g, w)
        assert _cosine(g, w) > 0.97  # the tiny checkpoints' scaled-up weights magnify rounding (0.988 seen)
    assert encoder.quantize("none") == []


def test_a_family_without_an_fp8_tower_refuses_it_by_name(tiny_model_dir):
    from common.vision.encoders import make_vision_encoder

    encoder = make_vision_encoder(tiny_model_dir)
    assert encoder.quantize("none") == []
    with pytest.raises(ValueError, match="no 'fp8' vision tower"):
        encoder.quantize("fp8")


def test_the_encoder_service_serves_an_fp8_tower(qwen3_model_dir, qwen_images):
    """--vision-quantization fp8 through Encode: the embedding is the FP8 tower's (equal to the in-process
    FP8 encoder's bytes), not the full-precision one's."""
    from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
    from common.images import encode_png
    from common.pb import common_pb2
    from common.transport import import_embedding
    from encoder_svc.config import EncoderConfig
    from tests.encoder.conftest import EncoderHarness, encode_request

    harness = EncoderHarness(EncoderConfig(model=qwen3_model_dir, cache_bytes=64 << 20, decode_processes=0,
                                           vision_quantization="fp8"))
    try:
        reply = harness.stub.Encode(encode_request(encode_png(qwen_images[0]),
                                                   accept=[common_pb2.TRANSPORT_INLINE]), timeout=60)
        served = import_embedding(reply.embeddings[0]).clone()
        harness.release_all(reply)
    finally:
        harness.close()
    reference = Qwen3VisionEncoder(qwen3_model_dir)
    (full,) = reference.encode([qwen_images[0]])
    reference.quantize("fp8")
    (fp8,) = reference.encode([qwen_images[0]])
    assert torch.equal(served.view_as(fp8), fp8) and not torch.equal(fp8, full)


def test_the_flag_takes_only_known_schemes(qwen3_model_dir):
    from encoder_svc.main import build_arg_parser

    parser = build_arg_parser()
    args = parser.parse_args(["--model", str(qwen3_model_dir), "--vision-quantization", "fp8"])
    assert args.vision_quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", str(qwen3_model_dir), "--vision-quantization", "int4"])
