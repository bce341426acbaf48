"""The vision runner equals Hugging Face's LlavaForConditionalGeneration.get_image_features."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from common.families.llava.encoder import LlavaVisionEncoder as VisionEncoder
from tests.encoder.conftest import image_bytes


def _images(n: int) -> list[Image.Image]:
    import io

    sizes = [(40, 32), (28, 28), (64, 20), (33, 47)]
    return [Image.open(io.BytesIO(image_bytes(i, sizes[i % 4]))).convert("RGB") for i in range(n)]


def _hf_features(model_dir: Path, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values,
                                       vision_feature_layer=model.config.vision_feature_layer,
                                       vision_feature_select_strategy=model.config.vision_feature_select_strategy)
    feats = getattr(out, "pooler_output", out)  # transformers 5.2x returns a model output
    return [f for f in feats]


@pytest.fixture(scope="module")
def vision(tiny_model_dir) -> VisionEncoder:
    return VisionEncoder(tiny_model_dir)


def test_single_and_batched_match_hf(vision, tiny_model_dir):
    images = _images(3)
    ref = _hf_features(tiny_model_dir, vision.preprocess(images))
    batched = vision.encode(images)
    single = [vision.encode([img])[0] for img in images]
    assert len(batched) == 3
    for r, b, s in zip(ref, batched, single, strict=True):
        assert b.shape == (vision.num_image_tokens, vision.hidden_size) == (16, 64)
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-5)
    # different images really give different embeddings (the check above could not pass by accident)
    assert (batched[0] - batched[1]).abs().max() > 1e-3
    assert vision.embedding_nbytes == 16 * 64 * 4


def _variant(src: Path, dst: Path, config_edit: dict, rename=None, tensors_edit=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.update(config_edit)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    if tensors_edit:
        tensors.update(tensors_edit)
    if rename:
        tensors = {rename(k): v for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_feature_layer_list_and_full_strategy_match_hf(tiny_model_dir, tmp_path):
    g = torch.Generator().manual_seed(3)
    # two layers concatenated: the projector's input doubles, so it gets new weights
    linear_1 = torch.randn(64, 64, generator=g) * 0.2
    d = _variant(tiny_model_dir, tmp_path / "multi",
                 {"vision_feature_layer": [0, -1], "vision_feature_select_strategy": "full"},
                 tensors_edit={"multi_modal_projector.linear_1.weight": linear_1})
    # The processor must say "full" too, or HF's placeholders and features differ (the encoder refuses).
    with pytest.raises(ValueError, match="strategy is 'default' but the model's is 'full'"):
        VisionEncoder(d)
    processor = json.loads((d / "processor_config.json").read_text())
    processor["vision_feature_select_strategy"] = "full"
    (d / "processor_config.json").write_text(json.dumps(processor))
    vision = VisionEncoder(d)
    images = _images(2)
    ours = vision.encode(images)
    ref = _hf_features(d, vision.preprocess(images))
    assert ours[0].shape == (17, 64)  # "full" keeps the CLS token
    for o, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["vision_tower.vision_model.", "model.vision_tower."])
def test_other_checkpoint_layouts_load(vision, tiny_model_dir, tmp_path, layout):
    def rename(key: str) -> str:
        if key.startswith("vision_tower."):
            return layout + key.removeprefix("vision_tower.")
        if key.startswith("multi_modal_projector.") and layout.startswith("model."):
            return "model." + key
        return key

    other = VisionEncoder(_variant(tiny_model_dir, tmp_path / "layout", {}, rename=rename))
    images = _images(2)
    for a, b in zip(other.encode(images), vision.encode(images), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(vision, tiny_model_dir, dtype):
    half = VisionEncoder(tiny_model_dir, dtype=dtype)
    images = _images(2)
    for h, f in zip(half.encode(images), vision.encode(images), strict=True):
        assert h.dtype == dtype
        torch.testing.assert_close(h.float(), f, rtol=0.1, atol=0.1)


def test_not_a_llava_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="vision_config"):
        VisionEncoder(tmp_path)
