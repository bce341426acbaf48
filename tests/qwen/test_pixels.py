"""The device-side Qwen2-VL processor (used on GPUs in half precision) against HF's PIL processor."""

from __future__ import annotations

from PIL import Image

from common.families.qwen2_5_vl.encoder import QwenVisionEncoder
from tests.oracle import make_image


def test_torch_pixels_within_tolerance_of_hf(qwen_model_dir):
    hf = QwenVisionEncoder(qwen_model_dir, preprocess="hf")
    dev = QwenVisionEncoder(qwen_model_dir, preprocess="torch")
    assert dev.preprocess_mode == "torch" and hf.pixel_tolerance == 0.0
    smooth = Image.linear_gradient("L").convert("RGB").resize((640, 480))
    cases = [(make_image(1, (480, 640)), False), (smooth, False), (make_image(2, (224, 224)), True),
             (Image.new("RGB", (300, 1000), (30, 60, 90)), True)]
    for image, exact in cases:
        ref, ours = hf.prepare(image), dev.prepare(image)
        assert ours.grid == ref.grid
        diff = (dev._rows(ours) - ref.pixel_values).abs()
        if exact:  # already on the 28-px grid: no resampling, the same rows
            assert diff.max().item() == 0.0
        else:
            assert diff.max().item() <= dev.pixel_tolerance
            assert diff.mean().item() <= dev.torch_pixels.max_mean_abs_diff()


def test_fused_padded_mlp_equals_separate():
    """The GPU's fused gate/up product with its zero-padded hidden width computes the same MLP."""
    import torch

    from common.families.qwen2_5_vl.tower import GatedMLP

    torch.manual_seed(0)
    mlp, x = GatedMLP(32, 70), torch.randn(50, 32)
    separate = mlp(x)
    mlp.fuse(multiple=64)
    assert mlp.fused_gate_up.weight.shape == (256, 32) and mlp.fused_down.weight.shape == (32, 128)
    torch.testing.assert_close(mlp(x), separate, rtol=1e-5, atol=1e-5)
