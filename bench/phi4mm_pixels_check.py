"""Phi-4-MM's HD transform (common/families/phi4mm/pixels.py) against Hugging Face's
Phi4MultimodalImageProcessor with the real torchvision (the GPU machine's image has it; CPU installs do
not, where tests/phi4mm/test_hf_processor.py runs HF's code over a torchvision stand-in instead).

    python -m bench.phi4mm_pixels_check            # exit status 1 on any mismatch; under a minute

For images of many sizes and aspect ratios, at the real checkpoint's dynamic_hd (36) and at the tiny
preset's (16, loaded through AutoProcessor from a freshly made phi-4-mm-tiny checkpoint, so its processor
config is checked too), it asserts: the same crop count and shapes, the same image_sizes, the same patch
masks, the same num_img_tokens (and pixels.num_tokens from the size alone), pixel values within --tol
(default 0: both run torch's own resize kernels on the CPU, so the bytes should be equal), and, for the
tiny checkpoint, the same input_ids for a prompt. With CUDA, HF's processor is also run with device="cuda"
(torchvision's float32-and-round path) against ours on a CUDA tensor, and against ours on the CPU (at most
two uint8 levels apart, 4/255 after normalising: HF's float path does not round to uint8, ours does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from common.families.phi4mm.pixels import (
    PixelSettings,
    batch_pixels,
    hd_transform,
    hd_transform_uint8,
    num_tokens,
    to_rgb_uint8,
)
from common.images import to_rgb

SIZES = [(448, 448), (300, 200), (1000, 500), (97, 900), (455, 460), (2000, 700), (4000, 900), (1500, 1500),
         (3000, 2000), (640, 480), (1920, 1080), (100, 3000), (5000, 200), (897, 449), (1, 1), (2048, 2048)]
# HF's CUDA path resizes in float and does not round to uint8; ours on the CPU does (torch's uint8
# kernel): measured on the H200 up to 1.6 levels apart (2/255 after normalising is one level).
TWO_LEVELS = 4 / 255 + 1e-6


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    out = []
    for w, h in SIZES:
        ramp = np.linspace(0, 160, w)[None, :, None] + np.linspace(0, 60, h)[:, None, None]
        pixels = np.clip(ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        out.append(Image.fromarray(pixels))
    # Transparency composited onto white first, as the services decode files (common.images.to_rgb,
    # transformers 5.2x's convert_to_rgb; 5.17's dropped the alpha instead, so both get RGB here).
    rgba = to_rgb(Image.fromarray(rng.integers(0, 256, (360, 640, 4), dtype=np.uint8)))
    return out + [rgba, Image.fromarray(rng.integers(0, 256, (520, 200), dtype=np.uint8))]


def _compare(name: str, image: Image.Image, ours: dict, hf: dict, tol: float, failures: list[str]) -> float:
    """Asserts one image's outputs agree; returns the pixels' max abs difference."""
    size = f"{name} {image.size[0]}x{image.size[1]} {image.mode}"
    if ours["image_pixel_values"].shape != hf["image_pixel_values"].shape:
        failures.append(f"{size}: crops {tuple(ours['image_pixel_values'].shape)} vs HF "
                        f"{tuple(hf['image_pixel_values'].shape)}")
        return float("inf")
    diff = (ours["image_pixel_values"].float().cpu()
            - hf["image_pixel_values"].float().cpu()).abs().max().item()
    if diff > tol:
        failures.append(f"{size}: pixel values differ by {diff:.3g} > {tol}")
    for key in ("image_attention_mask", "image_sizes"):
        if not torch.equal(ours[key].cpu().to(hf[key].dtype), hf[key].cpu()):
            failures.append(f"{size}: {key} differs")
    if [int(t) for t in ours["num_img_tokens"]] != [int(t) for t in hf["num_img_tokens"]]:
        failures.append(f"{size}: num_img_tokens {ours['num_img_tokens']} vs HF {list(hf['num_img_tokens'])}")
    return diff


def _check_processor(name: str, processor, settings: PixelSettings, tol: float, failures: list[str]) -> None:
    t0 = time.perf_counter()
    worst = 0.0
    for image in _images():
        try:
            hf = processor(images=[image], return_tensors="pt")
        except ValueError as exc:  # too extreme an aspect ratio: ours must refuse it too
            try:
                hd_transform(image, settings)
                failures.append(f"{name} {image.size}: HF refuses ({exc}), ours does not")
            except ValueError:
                pass
            continue
        ours = batch_pixels([hd_transform(image, settings)])
        worst = max(worst, _compare(name, image, ours, hf, tol, failures))
        if num_tokens(*image.size, dynamic_hd=settings.dynamic_hd) != int(hf["num_img_tokens"][0]):
            failures.append(f"{name} {image.size}: num_tokens from the size differs from HF's")
    batch = _images()[:4]
    hf = processor(images=batch, return_tensors="pt")
    ours = batch_pixels([hd_transform(im, settings) for im in batch])
    worst = max(worst, _compare(f"{name} batch", batch[0], ours, hf, tol, failures))
    print(f"{name}: {len(SIZES) + 2} images and a batch, max |pixel diff| {worst:.3g}, "
          f"{time.perf_counter() - t0:.1f} s")
    if torch.cuda.is_available():
        _check_cuda(name, processor, settings, tol, failures)


def _check_cuda(name: str, processor, settings: PixelSettings, tol: float, failures: list[str]) -> None:
    worst_same, worst_cpu = 0.0, 0.0
    for image in _images()[:10]:
        try:
            hf = processor(images=[image], return_tensors="pt", device="cuda")
        except TypeError as exc:  # an image processor without the device argument
            print(f"{name}: HF's processor takes no device ({exc}); CUDA comparison skipped")
            return
        except ValueError:
            continue
        ours = batch_pixels([hd_transform_uint8(to_rgb_uint8(image).cuda(), settings)])
        worst_same = max(worst_same, _compare(f"{name} cuda", image, ours, hf, tol, failures))
        cpu = batch_pixels([hd_transform(image, settings)])
        worst_cpu = max(worst_cpu, _compare(f"{name} cuda-vs-ours-cpu", image, cpu, hf, TWO_LEVELS, failures))
    print(f"{name} on CUDA: max |pixel diff| {worst_same:.3g} (ours on CUDA), {worst_cpu:.3g} (ours on CPU)")


def _check_tiny_checkpoint(tol: float, failures: list[str]) -> None:
    from transformers import AutoProcessor

    from common.checkpoint import load_config
    from common.families.phi4mm.layout import Phi4ImageLayout
    from common.families.phi4mm.maker import make_phi4_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_phi4_model("phi-4-mm-tiny", tmp, device="cpu", progress=False)
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        layout = Phi4ImageLayout.from_checkpoint(model_dir, load_config(model_dir))
        _check_processor("phi-4-mm-tiny (dynamic_hd 16)", processor.image_processor, layout.settings, tol,
                         failures)
        images = _images()[:3]
        markers = " and ".join(processor.image_token for _ in images)
        prompt = f"<|user|>{markers} what?<|end|><|assistant|>"
        hf = processor(text=prompt, images=images, return_tensors="pt")
        counts = [layout.tokens_for_size(*im.size) for im in images]
        ids = processor.tokenizer(layout.expand_prompt(prompt, counts))["input_ids"]
        if ids != hf["input_ids"][0].tolist():
            failures.append("phi-4-mm-tiny: input_ids differ from HF's processor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tol", type=float, default=0.0, help="max |pixel diff| allowed (normalised units)")
    args = parser.parse_args(argv)
    from transformers.models.phi4_multimodal import image_processing_phi4_multimodal as hf_module

    names = ("Phi4MultimodalImageProcessor", "Phi4MultimodalImageProcessorFast")  # 5.24, older 5.x
    cls = next(getattr(hf_module, n) for n in names if hasattr(hf_module, n))
    failures: list[str] = []
    t0 = time.perf_counter()
    _check_processor(f"{cls.__name__} defaults (dynamic_hd 36)", cls(), PixelSettings(), args.tol, failures)
    _check_tiny_checkpoint(args.tol, failures)
    for line in failures:
        print("MISMATCH", line)
    print(f"{'FAILED' if failures else 'OK'}: {len(failures)} mismatches, {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
