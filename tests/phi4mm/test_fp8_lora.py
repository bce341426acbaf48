"""Phi-4-MM under `--quantization fp8` (CPU): the checkpoint's pre-fused qkv_proj and gate_up_proj are
quantized as they are, each wrapped by the vision adapter's LoRALinear, whose product is added on top of
the FP8 base product for slot-1 rows only; image requests still run under the adapter."""

from __future__ import annotations

import pytest
import torch

from common.families.phi4mm.layout import Phi4ImageLayout
from common.images import encode_png
from decoder_svc.model.lora import LoRALinear
from decoder_svc.model.quant.linear import Fp8Linear
from tests.oracle import greedy
from tests.phi4mm.images import sample_images
from tests.phi4mm.test_vision_lora import ONE, _run, make_engine


@pytest.fixture(scope="module")
def fp8_engine(phi4_tiny_dir):
    return make_engine(phi4_tiny_dir, quantization="fp8")


@pytest.mark.parametrize("path", ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                  "mlp.down_proj"])
def test_the_lora_delta_adds_to_the_fp8_product(fp8_engine, path):
    block, name = path.split(".")
    module = getattr(getattr(fp8_engine.model.layers[1], block), name)
    assert isinstance(module, LoRALinear) and isinstance(module.base, Fp8Linear)
    assert module.lora_a.shape[0] == 2 * module.rank  # slot 0 (none) and the vision adapter
    x = torch.randn(4, module.in_features)
    module.slots.bind(torch.tensor([0, 1, 1, 0]), 4)
    out, base = module(x), module.base(x)
    assert torch.equal(out[0], base[0]) and torch.equal(out[3], base[3])
    cols = slice(module.rank, 2 * module.rank)
    delta = (x[1:3] @ module.lora_a[cols].T) @ module.lora_b[:, cols].T
    assert delta.abs().max() > 1e-2  # the adapter is not a no-op
    torch.testing.assert_close(out[1:3], base[1:3] + delta, rtol=1e-5, atol=1e-5)


def test_image_requests_run_the_adapter_in_fp8(fp8_engine, monkeypatch):
    """The family's pick (vision) and a request naming it agree; picking none gives other tokens."""
    picked = _run(fp8_engine, "img", ONE).new_token_ids
    named = fp8_engine.generate("named", ONE[0], _files(ONE), sampling=greedy(10),
                                lora_adapter="vision").new_token_ids
    monkeypatch.setattr(Phi4ImageLayout, "request_adapter", lambda self, has_images, has_videos: None)
    base = fp8_engine.generate("base", ONE[0], _files(ONE), sampling=greedy(10)).new_token_ids
    assert picked == named != base


def _files(case: tuple) -> list[bytes]:
    return [encode_png(sample_images()[i]) for i in case[1]]
