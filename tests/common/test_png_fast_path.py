"""The encoder's PNG decode: libspng for plain 8-bit RGB PNGs, Pillow for everything else, the same
pixels and the same errors either way (common/images.decode_image_array against decode_image)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import common.images as images
from common.images import ImageError, ImageLimits, decode_image, decode_image_array

pytest.importorskip("pyspng")


@pytest.fixture
def spng_calls(monkeypatch):
    """How many files libspng decoded."""
    calls = []
    real = images.pyspng.load

    def counting(data, format=None):  # noqa: A002 - pyspng's name
        calls.append(len(data))
        return real(data, format=format)

    monkeypatch.setattr(images.pyspng, "load", counting)
    return calls


def _pil_png(array: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", **save)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _paeth(left: np.ndarray, up: np.ndarray, upleft: np.ndarray) -> np.ndarray:
    a, b, c = (x.astype(np.int16) for x in (left, up, upleft))
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c)).astype(np.uint8)


def _png_with_filters(rgb: np.ndarray, filters: list[int]) -> bytes:
    """An 8-bit RGB PNG whose row r is written with filter filters[r] (0 None, 1 Sub, 2 Up, 3 Average,
    4 Paeth): Pillow's writer chooses its own and never Average."""
    height, width, _ = rgb.shape
    rows = rgb.reshape(height, width * 3)
    out = []
    for r, kind in enumerate(filters):
        raw = rows[r]
        up = rows[r - 1] if r else np.zeros_like(raw)
        left = np.concatenate([np.zeros(3, np.uint8), raw[:-3]])
        upleft = np.concatenate([np.zeros(3, np.uint8), up[:-3]])
        predictor = [np.zeros_like(raw), left, up,
                     ((left.astype(np.uint16) + up) // 2).astype(np.uint8), _paeth(left, up, upleft)][kind]
        out.append(bytes([kind]) + (raw - predictor).astype(np.uint8).tobytes())
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"".join(out)))
            + _chunk(b"IEND", b""))


@pytest.mark.parametrize("size", [(1, 1), (5, 7), (33, 17), (64, 129)])
@pytest.mark.parametrize("save", [{}, {"compress_level": 0}, {"compress_level": 9}, {"optimize": True}])
def test_plain_rgb_pngs_decode_by_libspng_to_pillows_pixels(spng_calls, size, save):
    rng = np.random.default_rng(size[0] * 1000 + size[1])
    noise = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    smooth = np.cumsum(rng.integers(-3, 4, (*size, 3)), axis=1).astype(np.uint8)
    for array in (noise, smooth):
        data = _pil_png(array, **save)
        got = decode_image_array(data)
        assert got.dtype == np.uint8 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, np.asarray(decode_image(data)))
        np.testing.assert_array_equal(got, array)
    assert len(spng_calls) == 2


@pytest.mark.parametrize("seed", range(3))
def test_every_row_filter_and_interlacing(spng_calls, seed):
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (23, 31, 3), dtype=np.uint8)
    filtered = _png_with_filters(rgb, [int(f) for f in rng.integers(0, 5, 23)])
    interlaced = _pil_png(rgb, interlace=1)
    for data in (filtered, interlaced):
        np.testing.assert_array_equal(decode_image_array(data), rgb)
        np.testing.assert_array_equal(np.asarray(decode_image(data)), rgb)
    assert len(spng_calls) == 2


def _other_pngs() -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (9, 11, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (9, 11, 4), dtype=np.uint8)
    out = {"rgba": _pil_png(rgba), "gray": _pil_png(rgb[..., 0])}
    out["rgb with a transparent colour"] = _pil_png(rgb, transparency=tuple(int(v) for v in rgb[0, 0]))
    buf = io.BytesIO()
    Image.fromarray(rgb).quantize(16).save(buf, format="PNG")
    out["palette"] = buf.getvalue()
    samples = (rgb.astype(">u2") * 257).reshape(9, 33)  # 16-bit RGB: Pillow opens it as mode "RGB" too
    rows = b"".join(b"\0" + row.tobytes() for row in samples)
    header = struct.pack(">IIBBBBB", 11, 9, 16, 2, 0, 0, 0)
    out["16-bit rgb"] = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows))
                         + _chunk(b"IEND", b""))
    buf = io.BytesIO()
    frames = [Image.fromarray(rgb), Image.fromarray(255 - rgb)]
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    out["animated"] = buf.getvalue()
    return out


@pytest.mark.parametrize("kind", ["rgba", "gray", "rgb with a transparent colour", "palette", "16-bit rgb",
                                  "animated"])
def test_other_pngs_stay_with_pillow(spng_calls, kind):
    data = _other_pngs()[kind]
    np.testing.assert_array_equal(decode_image_array(data), np.asarray(decode_image(data)))
    assert spng_calls == []


def test_a_file_libspng_refuses_is_pillows_to_judge(spng_calls):
    rgb = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    data = bytearray(_png_with_filters(rgb, [1] * 16))
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    data[idat + 4 + length] ^= 0xFF  # the IDAT's CRC, which Pillow does not check
    np.testing.assert_array_equal(decode_image_array(bytes(data)), rgb)
    assert len(spng_calls) == 1
    truncated = bytes(data[:idat + 40])
    for decode in (decode_image, decode_image_array):
        with pytest.raises(ImageError, match="cannot decode image"):
            decode(truncated)


def test_limits_are_checked_before_any_decoding(spng_calls):
    data = _pil_png(np.zeros((40, 50, 3), np.uint8))
    with pytest.raises(ImageError, match="maximum side"):
        decode_image_array(data, ImageLimits(max_side=45))
    with pytest.raises(ImageError, match="pixels allowed"):
        decode_image_array(data, ImageLimits(max_pixels=1999))
    assert spng_calls == []
