"""Preprocessing off the tower's thread: the torch reproduction of the image processor (its stated
tolerance against the HF processor), and the exactness of both modes against get_image_features."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from common.families.llava.encoder import LlavaVisionEncoder as VisionEncoder
from common.pb import common_pb2
from common.vision.pixels import (
    MAX_LEVELS,
    MAX_MEAN_LEVELS,
    TorchPixelProcessor,
    UnsupportedProcessorError,
    recipe_from_processor,
    to_uint8_chw,
)
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request
from tests.encoder.test_vision import _hf_features

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# (width, height): the target itself, down- and up-scales, both orientations, odd sizes
SIZES = [(336, 336), (337, 336), (640, 480), (100, 500), (200, 150), (40, 32), (13, 9)]


def _clip_processor(side: int):
    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as cls
    except ImportError:  # older transformers: the numpy/PIL processor is the plain one
        from transformers import CLIPImageProcessor as cls
    return cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
               image_mean=CLIP_MEAN, image_std=CLIP_STD)


def _image(kind: str, width: int, height: int, seed: int = 0) -> Image.Image:
    if kind == "noise":  # the worst case for a resampling filter: every pixel an edge
        arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        yy, xx = np.mgrid[0:height, 0:width]
        arr = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1), (xx + yy) % 256],
                       -1).astype(np.uint8)
    return Image.fromarray(arr)


def assert_within_tolerance(tp: TorchPixelProcessor, got: torch.Tensor, ref: torch.Tensor, kind: str,
                            case) -> None:
    """The stated bounds (encoder_svc/pixels.py): per pixel, per image mean, and a few levels on smooth
    images."""
    diff = (got - ref).abs()
    assert diff.max().item() <= tp.max_abs_diff(), case
    assert diff.mean().item() <= tp.max_mean_abs_diff(), case
    if kind == "gradient":  # smooth: no clipped overshoot, only rounding and pass-order effects
        assert diff.max().item() <= 8 * tp.level(), case


@pytest.mark.parametrize("side", [28, 336])
def test_torch_pixels_within_the_stated_tolerance_of_hf(side):
    hf = _clip_processor(side)
    tp = TorchPixelProcessor(hf)
    # a level is the rescale over the smallest std
    assert tp.max_abs_diff() == pytest.approx(MAX_LEVELS / 255 / min(CLIP_STD), rel=1e-4)
    assert tp.max_mean_abs_diff() == pytest.approx(MAX_MEAN_LEVELS / 255 / min(CLIP_STD), rel=1e-4)
    differing = []
    for width, height in SIZES:
        for kind in ("noise", "gradient"):
            img = _image(kind, width, height)
            ref = hf(images=[img], return_tensors="pt")["pixel_values"]
            got = tp([to_uint8_chw(img)])
            assert got.shape == ref.shape == (1, 3, side, side) and got.dtype == torch.float32
            assert_within_tolerance(tp, got, ref, kind, (side, width, height, kind))
            if (width, height) == (side, side) or (side == 336 and (width, height) == (337, 336)):
                # no resampling needed (or only a crop): the processor's own arithmetic, bit for bit
                assert torch.equal(got, ref), (side, width, height, kind)
            differing.append(((got - ref).abs() > 0).float().mean().item())
    # the bounds are not hiding a different filter: most pixels are the same
    assert max(differing) < 0.35 and sum(differing) / len(differing) < 0.1


def test_random_shapes_within_the_stated_tolerance():
    """Shapes drawn at random (fixed seed): portrait and landscape, up and down, CLIP-style and square."""
    rng = np.random.default_rng(3)
    for _ in range(24):
        side = int(rng.integers(16, 120))
        width, height = (int(v) for v in rng.integers(8, 240, 2))
        for hf in (_clip_processor(side), _square_processor(side)):
            tp = TorchPixelProcessor(hf)
            for kind in ("noise", "gradient"):
                img = _image(kind, width, height, seed=int(rng.integers(1 << 30)))
                ref = hf(images=[img], return_tensors="pt")["pixel_values"]
                got = tp([to_uint8_chw(img)])
                assert_within_tolerance(tp, got, ref, kind, (type(hf).__name__, side, width, height, kind))


def _square_processor(side: int):
    try:
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil as cls
    except ImportError:
        from transformers import SiglipImageProcessor as cls
    return cls(size={"height": side, "width": side}, resample=3, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def test_a_batch_of_mixed_sizes_keeps_its_order():
    hf = _clip_processor(28)
    tp = TorchPixelProcessor(hf)
    imgs = [_image("noise", w, h, seed=i) for i, (w, h) in enumerate([(28, 28), (40, 32), (28, 28), (13, 9)])]
    batch = tp([to_uint8_chw(i) for i in imgs])
    for i, img in enumerate(imgs):
        assert torch.equal(batch[i], tp([to_uint8_chw(img)])[0])
    assert torch.equal(batch[0], hf(images=[imgs[0]], return_tensors="pt")["pixel_values"][0])


def test_processors_it_cannot_reproduce_are_refused():
    hf = _clip_processor(28)
    hf.do_pad = True
    with pytest.raises(UnsupportedProcessorError, match="do_pad"):
        recipe_from_processor(hf)
    hf = _clip_processor(28)
    hf.resample = 1  # Lanczos
    with pytest.raises(UnsupportedProcessorError, match="resample"):
        recipe_from_processor(hf)


def _same_size_images(n: int, side: int) -> list[Image.Image]:
    return [_image("noise", side, side, seed=10 + i) for i in range(n)]


def _mixed_images() -> list[Image.Image]:
    return [_image("noise", w, h, seed=20 + i) for i, (w, h) in enumerate([(40, 32), (28, 28), (64, 20)])]


def test_hf_mode_is_exactly_get_image_features_on_the_processors_pixels(tiny_model_dir):
    """The CPU fp32 contract: prepared image by image in threads, the batch is bit-identical to HF's."""
    vision = VisionEncoder(tiny_model_dir)  # auto on CPU
    assert vision.preprocess_mode == "hf" and vision.pixel_tolerance == 0.0
    images = _mixed_images()
    pixels = vision.preprocess(images)
    assert torch.equal(vision.pixels([vision.prepare(i) for i in images]), pixels)
    ref = _hf_features(tiny_model_dir, pixels)
    for got, want in zip(vision.encode(images), ref, strict=True):
        assert (got - want).abs().max().item() == 0.0


def test_torch_mode_on_cpu_matches_hf(tiny_model_dir):
    vision = VisionEncoder(tiny_model_dir, preprocess="torch")
    assert vision.preprocess_mode == "torch" and vision.pixel_tolerance > 0
    side = vision.config.vision_config.image_size
    # images at the processor's size need no resampling: exact, like the HF path
    images = _same_size_images(2, side)
    ref = _hf_features(tiny_model_dir, vision.preprocess(images))
    for got, want in zip(vision.encode(images), ref, strict=True):
        assert (got - want).abs().max().item() == 0.0
    # resized images: pixels within the tolerance, so the embeddings are close but not bit-equal
    images = _mixed_images()
    pixels = vision.pixels([vision.prepare(i) for i in images])
    assert (pixels - vision.preprocess(images)).abs().max().item() <= vision.pixel_tolerance
    ref = _hf_features(tiny_model_dir, vision.preprocess(images))
    for got, want in zip(vision.encode(images), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0.05)


def test_torch_mode_refused_for_a_processor_it_cannot_reproduce(tiny_model_dir, tmp_path):
    import json
    import shutil

    dst = tmp_path / "padded"
    shutil.copytree(tiny_model_dir, dst)
    names = ("preprocessor_config.json", "processor_config.json")
    cfg_path = next(dst / name for name in names if (dst / name).exists())
    cfg = json.loads(cfg_path.read_text())
    target = cfg.get("image_processor", cfg)
    target["resample"] = 1  # Lanczos: no torch equivalent
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--preprocess torch cannot reproduce"):
        VisionEncoder(dst, preprocess="torch")
    assert VisionEncoder(dst, preprocess="auto").preprocess_mode == "hf"


def test_encode_rpc_with_torch_preprocessing(tiny_model_dir):
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, cache_bytes=1 << 20, preprocess="torch",
                                           preprocess_threads=2, max_batch_images=4))
    try:
        from common.transport import import_embedding

        vision = harness.servicer.vision
        side = vision.config.vision_config.image_size
        img = _image("noise", side, side, seed=99)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        resp = harness.stub.Encode(encode_request(buf.getvalue(), accept=[common_pb2.TRANSPORT_INLINE]),
                                   timeout=60)
        got = import_embedding(resp.embeddings[0])
        (want,) = _hf_features(tiny_model_dir, vision.preprocess([img]))
        assert (got - want).abs().max().item() == 0.0
    finally:
        harness.close()


def test_graph_buckets_and_no_graphs_on_cpu(tiny_model_dir):
    from common.vision.graphs import bucket_sizes

    assert bucket_sizes(1) == [1] and bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(12) == [1, 2, 4, 8, 12]
    vision = VisionEncoder(tiny_model_dir)
    assert not vision.capture_graphs(4) and vision.graphs is None
    img = _image("noise", 30, 30)
    assert torch.equal(vision.encode_prepared([vision.prepare(img)], use_graphs=True)[0],
                       vision.encode([img])[0])


def test_siglip_square_resize_within_tolerance():
    hf = _square_processor(48)
    tp = TorchPixelProcessor(hf)
    assert tp.recipe.resize_hw == (48, 48) and tp.recipe.crop_hw is None
    for width, height in [(48, 48), (64, 20), (30, 90), (13, 9)]:
        for kind in ("noise", "gradient"):
            img = _image(kind, width, height, seed=width)
            ref = hf(images=[img], return_tensors="pt")["pixel_values"]
            got = tp([to_uint8_chw(img)])
            assert got.shape == ref.shape == (1, 3, 48, 48)
            assert_within_tolerance(tp, got, ref, kind, (width, height, kind))
            if (width, height) == (48, 48):
                assert torch.equal(got, ref)
