"""Image limits at their edges and the format allowlist, in common/images.py (used by the gateway, the
encoder, its decode processes and the decoder's header reads)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from common.images import ImageError, ImageLimits, decode_image, encode_png, probe_image_size


def _encoded(fmt: str, size: tuple[int, int] = (8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format=fmt)
    return buf.getvalue()


def test_the_pixel_limit_itself_is_accepted_and_one_pixel_over_is_refused():
    limits = ImageLimits()
    at_limit = encode_png(Image.new("RGB", (4096, 4096)))  # exactly max_pixels
    assert probe_image_size(at_limit, limits) == (4096, 4096)
    with pytest.raises(ImageError, match="more than the 16777216 pixels"):
        probe_image_size(encode_png(Image.new("RGB", (4097, 4096))), limits)  # 4096 pixels over
    small = ImageLimits(max_pixels=100)
    assert probe_image_size(encode_png(Image.new("RGB", (10, 10))), small) == (10, 10)
    with pytest.raises(ImageError, match="more than the 100 pixels"):
        probe_image_size(encode_png(Image.new("RGB", (101, 1))), small)  # one pixel over


@pytest.mark.parametrize("fmt", ["EPS", "TIFF", "ICO", "PCX", "TGA", "SGI", "DDS"])
def test_formats_outside_the_allowlist_are_refused_from_the_header(fmt):
    data = _encoded(fmt)
    for read in (probe_image_size, decode_image):
        with pytest.raises(ImageError, match="not an accepted image format"):
            read(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_documented_formats_decode(fmt):
    assert decode_image(_encoded(fmt)).size == (8, 8)


def test_the_allowlist_is_configurable():
    tiff = _encoded("TIFF")
    assert decode_image(tiff, ImageLimits(formats="png,tiff")).size == (8, 8)
    with pytest.raises(ImageError, match="accepted: PNG, TIFF"):
        decode_image(_encoded("JPEG"), ImageLimits(formats="png,tiff"))
    with pytest.raises(ValueError):
        ImageLimits(formats="EPS")


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_onto_white_as_hf_does(mode):
    """A transparent image decodes to the RGB pixels transformers' convert_to_rgb gives (what the HF
    processors' do_convert_rgb feeds them): transparency over white, not the hidden colour under it."""
    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    rgba = Image.effect_noise((40, 30), 60).convert("RGBA")
    alpha = Image.linear_gradient("L").resize((40, 30))
    rgba.putalpha(alpha)
    img = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(16)
    if mode == "P":
        img.info["transparency"] = 3
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    got = np.asarray(decode_image(buf.getvalue()))
    want = np.asarray(convert_to_rgb(Image.open(io.BytesIO(buf.getvalue())), return_numpy=True))
    assert got.shape == want.shape and (got == want).all()
    assert not (got == np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))).all()
