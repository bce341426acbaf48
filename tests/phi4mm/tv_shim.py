"""A stand-in for the few torchvision functions Hugging Face's Phi4MultimodalImageProcessor calls, so that
HF's own processor code (crop choice, padding, masks, token counts, global view, batching, prompt
expansion) runs on CPU machines without torchvision, in a subprocess (tests/phi4mm/test_hf_processor.py).

Each function follows torchvision.transforms.v2.functional's tensor kernels (resize_image: native uint8
bilinear on AVX2/AVX-512 CPUs, else float32 then round; pad; normalize); they call the same torch ops.
That torchvision itself agrees is checked where it is installed: bench/phi4mm_pixels_check.py.
"""

from __future__ import annotations

from pathlib import Path

FUNCTIONAL = '''
import enum
import torch
from torch.nn.functional import interpolate


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    if isinstance(interpolation, int):
        raise TypeError("the shim takes InterpolationMode values only")
    shape = image.shape
    c, old_h, old_w = shape[-3:]
    new_h, new_w = size
    if (new_h, new_w) == (old_h, old_w):
        return image
    if interpolation not in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        raise NotImplementedError(interpolation)
    dtype = image.dtype
    ok = [torch.float32, torch.float64]
    if image.device.type == "cpu" and (interpolation == InterpolationMode.BICUBIC or
                                       torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        ok.append(torch.uint8)
    x = image.reshape(-1, c, old_h, old_w)
    strides = x.stride()
    if x.is_contiguous(memory_format=torch.channels_last) and x.shape[0] == 1 and x.numel() != strides[0]:
        new_strides = list(strides)
        new_strides[0] = x.numel()
        x = x.as_strided((1, c, old_h, old_w), new_strides)
    cast = dtype not in ok
    if cast:
        x = x.to(torch.float32)
    x = interpolate(x, size=[new_h, new_w], mode=interpolation.value, align_corners=False,
                    antialias=antialias)
    if cast:
        if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
            x = x.clamp_(min=0, max=255)
        if not dtype.is_floating_point:
            x = x.round_()
        x = x.to(dtype)
    return x.reshape(shape[:-3] + (c, new_h, new_w))


def pad(image, padding, fill=0, padding_mode="constant"):
    left, top, right, bottom = padding
    value = fill[0] if isinstance(fill, (list, tuple)) else fill
    if isinstance(fill, (list, tuple)) and len(set(fill)) != 1:
        raise NotImplementedError("per-channel fill")
    return torch.nn.functional.pad(image, (left, right, top, bottom), mode=padding_mode, value=value)


def normalize(tensor, mean, std, inplace=False):
    if not inplace:
        tensor = tensor.clone()
    mean = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


def grayscale_to_rgb(image):
    return image.expand(*image.shape[:-3], 3, *image.shape[-2:]) if image.shape[-3] == 1 else image
'''


def write_shim(root: Path) -> Path:
    """A `torchvision` package (with its dist-info, so transformers sees it installed) under root."""
    pkg = root / "torchvision"
    (pkg / "transforms" / "v2").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.26.0"\nfrom . import io\n')
    (pkg / "io.py").write_text("")  # imported (not used here) by transformers.video_utils
    (pkg / "transforms" / "__init__.py").write_text("from .v2.functional import InterpolationMode\n")
    # imported (not called on this path) by transformers.image_utils
    stub = "def pil_to_tensor(image):\n    raise NotImplementedError\n"
    (pkg / "transforms" / "functional.py").write_text(stub)
    (pkg / "transforms" / "v2" / "__init__.py").write_text("")
    (pkg / "transforms" / "v2" / "functional.py").write_text(FUNCTIONAL)
    meta = root / "torchvision-0.26.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.26.0\n")
    return root
