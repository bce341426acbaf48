"""Our image embedding (pixels.py's crops through tower.py and embedder.py, via the encoder) against HF's
Phi4MultimodalImageEmbedding on the same pixel inputs, fp32 on CPU: one crop, several, portrait,
landscape, past dynamic_hd, RGBA; one image at a time and several in one call."""

from __future__ import annotations

import pytest
import torch

from common.families.phi4mm.encoder import Phi4VisionEncoder
from tests.phi4mm.images import sample_images

# fp32 with the same op order but different attention kernels (SDPA vs HF's eager): ~1e-6 seen
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def encoder(phi4_tiny_dir) -> Phi4VisionEncoder:
    return Phi4VisionEncoder(phi4_tiny_dir)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    assert scale > 1.0, "the tiny checkpoint's features should not be degenerate"
    assert (ours - ref).abs().max().item() <= REL_TOL * scale


@pytest.mark.parametrize("index", [0, 1, 3, 5, 6, 8])
def test_one_image_equals_hf(encoder, phi4_oracle, index):
    image = sample_images()[index]
    (ref,) = phi4_oracle.image_features([image])
    (ours,) = encoder.encode([image])
    assert ours.shape[0] == encoder.layout.tokens_for_size(*image.size)
    _close(ours, ref)


def test_several_images_in_one_call_equal_hf_one_by_one(encoder, phi4_oracle):
    images = [sample_images()[i] for i in (0, 2, 4)]
    ours = encoder.encode(images)
    for image, got in zip(images, ours, strict=True):
        (ref,) = phi4_oracle.image_features([image])
        _close(got, ref)


def test_images_differ_and_the_separators_are_where_hf_puts_them(encoder, phi4_oracle):
    a, b = encoder.encode([sample_images()[0], sample_images()[4]])
    # the global view's rows (the last 272) differ between two images: the features carry the pixels
    assert (a[-272:] - b[-272:]).abs().max() > 1e-2
    # every row separator projects to the same row: sub_GN after each of the global view's 16 rows
    gn = a[-272:].reshape(16, 17, -1)[:, 16]
    assert torch.allclose(gn, gn[0].expand_as(gn))


def test_preprocessing_modes(phi4_tiny_dir, encoder):
    """"hf" transforms on the host in `prepare`; "torch" hands the device uint8 pixels and transforms them
    in `encode_prepared` (on a CPU device the same kernels, so the same embedding); "auto" is "hf" here."""
    assert encoder.preprocess_mode == "hf" and encoder.pixel_tolerance == 0.0
    device_side = Phi4VisionEncoder(phi4_tiny_dir, preprocess="torch")
    assert device_side.preprocess_mode == "torch" and 0 < device_side.pixel_tolerance < 0.05
    images = [sample_images()[i] for i in (0, 3, 6)]
    prepared = [device_side.prepare(image) for image in images]
    assert all(p.dtype == torch.uint8 and p.shape[-1] == 3 for p in prepared)  # [H, W, 3]
    for got, want in zip(device_side.encode_prepared(prepared), encoder.encode(images), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="preprocess must be one of"):
        Phi4VisionEncoder(phi4_tiny_dir, preprocess="gpu")
