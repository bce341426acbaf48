"""Gemma3VisionEncoder equals HF's Gemma3ForConditionalGeneration.get_image_features in fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from common.families.gemma3 import FAMILY
from tests.gemma3.conftest import sample_images


def test_equals_hf_image_features(gemma3_tiny_dir: Path, gemma3_oracle) -> None:
    encoder = FAMILY.make_vision_encoder(gemma3_tiny_dir)
    images = sample_images()
    ours = encoder.encode(images)
    want = gemma3_oracle.image_features(gemma3_oracle.pixels(images))
    assert len(ours) == len(images)
    for got, ref in zip(ours, want, strict=True):
        assert got.shape == (encoder.num_image_tokens, encoder.hidden_size)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_one_at_a_time_equals_batch(gemma3_tiny_dir: Path) -> None:
    encoder = FAMILY.make_vision_encoder(gemma3_tiny_dir)
    images = sample_images()
    batch = encoder.encode(images)
    for image, row in zip(images, batch, strict=True):
        torch.testing.assert_close(encoder.encode([image])[0], row, atol=1e-5, rtol=1e-5)
    assert encoder.calls == 1 + len(images) and encoder.images_encoded == 2 * len(images)


def test_warm_up_and_size(gemma3_tiny_dir: Path) -> None:
    encoder = FAMILY.make_vision_encoder(gemma3_tiny_dir)
    encoder.warm_up()
    assert encoder.embedding_nbytes == 16 * 64 * 4
    assert encoder.preprocess_mode == "hf"


def test_hub_tensor_names(gemma3_tiny_dir: Path, gemma3_oracle, tmp_path: Path) -> None:
    """transformers 5 saves the tower as `vision_tower.*`; the Hub's checkpoints (saved by transformers 4)
    say `vision_tower.vision_model.*`: the same tensors under those names encode the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    for path in gemma3_tiny_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    tensors = load_file(str(gemma3_tiny_dir / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = tensor
    assert any(n.startswith("vision_tower.vision_model.") for n in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    images = sample_images()[:2]
    ours = FAMILY.make_vision_encoder(tmp_path).encode(images)
    want = gemma3_oracle.image_features(gemma3_oracle.pixels(images))
    torch.testing.assert_close(torch.stack(ours), want, atol=1e-5, rtol=1e-5)


def test_torch_preprocessing_within_its_tolerance_of_hf(gemma3_tiny_dir: Path, gemma3_oracle) -> None:
    """--preprocess torch (the default on CUDA in half precision): the uint8 image resized and normalised
    on the device, pixel values within the stated tolerance of HF's PIL processor and close on average;
    the features close to HF's get_image_features; mixed with hf-prepared images in one batch."""
    from common.families.gemma3.encoder import Gemma3VisionEncoder

    dev = Gemma3VisionEncoder(gemma3_tiny_dir, preprocess="torch")
    assert dev.preprocess_mode == "torch" and dev.pixel_tolerance > 0
    hf = FAMILY.make_vision_encoder(gemma3_tiny_dir)
    assert hf.preprocess_mode == "hf" and hf.pixel_tolerance == 0.0
    images = sample_images()
    prepared = [dev.prepare(img) for img in images]
    assert all(p.dtype == torch.uint8 for p in prepared)
    pixels = torch.cat(dev._device_pixels(prepared))
    want = gemma3_oracle.pixels(images)
    diff = (pixels - want).abs()
    assert diff.max().item() <= dev.pixel_tolerance
    assert diff.mean().item() <= dev.pixel_processor.max_mean_abs_diff()
    feats = gemma3_oracle.image_features(want)
    mixed = dev.encode_prepared([prepared[0], hf.prepare(images[1]), prepared[2]])
    for got, i in zip(mixed, (0, 1, 2), strict=True):
        torch.testing.assert_close(got, feats[i], rtol=0, atol=0.05)
    torch.testing.assert_close(mixed[1], feats[1], rtol=1e-5, atol=1e-5)  # the HF-prepared one: exact
