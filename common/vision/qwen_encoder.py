"""The vision half of a Qwen2.5-VL checkpoint: image processor and tower, with VisionEncoder's interface.

An image's rows depend on its size: `prepare` resizes it within its pixel range (the checkpoint's
min/max pixels, or a request's narrower range) with the checkpoint's Hugging Face image processor (PIL
backend: exact, and no torchvision needed), and `encode_prepared` runs several prepared images through
the tower in one forward (common/vision/qwen_tower.py), returning one [tokens, hidden] tensor each.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import CheckpointError, load_config, model_fingerprint
from common.qwen_layout import Grid, PixelRange, load_qwen_layout
from common.video.config import load_qwen_video_config
from common.video.timestamps import VideoTiming
from common.vision import PREPROCESS_MODES
from common.vision.pixels import to_uint8_hwc
from common.vision.qwen_pixels import QwenTorchPixels
from common.vision.qwen_tower import load_qwen_tower

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QwenPrepared:
    """One image or video ready for the tower: its grid, and either patch rows [t*h*w, patch_dim] from the
    HF processor or common/video (fp32, host) or an image's uint8 [H, W, 3] pixels for the device-side
    processor; a video also has its timing (kept with its cache entry)."""

    grid: Grid
    pixel_values: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    timing: VideoTiming | None = None


def load_qwen_image_processor(model_dir: str | Path):
    """The checkpoint's Qwen2-VL image processor with the PIL backend (transformers >= 5.2 names it
    Qwen2VLImageProcessorPil; earlier 5.x releases' Qwen2VLImageProcessor is that one)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Processor
    return Processor.from_pretrained(str(model_dir), local_files_only=True)


class QwenVisionEncoder:
    """Images to Qwen2.5-VL image embeddings, [tokens, text hidden] per image (tokens from its grid).

    Thread-safety as VisionEncoder: `prepare` on any thread; `encode_prepared` from one thread at a time.
    """

    graphs = None  # shapes vary per batch: no CUDA graphs (see docs/architecture.md)

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, not {preprocess!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        config = load_config(self.model_dir)
        if config.get("model_type") != "qwen2_5_vl":  # Qwen3-VL shares the layout, not the tower
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen2.5-VL checkpoint")
        self.layout = load_qwen_layout(self.model_dir)
        self.video_config = load_qwen_video_config(self.model_dir)  # videos: sampling, resize, normalisation
        self.fingerprint = model_fingerprint(self.model_dir)
        self.hidden_size = int((config.get("text_config") or config)["hidden_size"])
        self.tower = load_qwen_tower(self.model_dir, config["vision_config"], self.device, dtype)
        if self.tower.merger.mlp[2].out_features != self.hidden_size:
            raise ValueError("the vision merger's output width differs from the language model's hidden size")
        self.image_processor = load_qwen_image_processor(self.model_dir)
        # "auto": on the device in half precision (the tower's rounding dwarfs a pixel level), else HF's
        # processor (fp32 keeps bit parity with HF, the oracle tests' contract).
        on_device = preprocess == "torch" or (preprocess == "auto" and self.device.type == "cuda"
                                              and dtype != torch.float32)
        self.preprocess_mode = "torch" if on_device else "hf"
        self.torch_pixels = QwenTorchPixels(self.image_processor) if on_device else None
        self.default_pixels = PixelRange(self.layout.min_pixels, self.layout.max_pixels)
        self.calls = 0
        self.images_encoded = 0
        self._count_lock = threading.Lock()

    def nbytes_for(self, grid: Sequence[int]) -> int:
        """Bytes of the embedding of an image of this grid, in the output dtype."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layout.num_tokens(grid) * self.hidden_size * itemsize

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of the largest image's embedding (max_pixels): what the cache must be able to hold."""
        side = int(self.layout.max_pixels ** 0.5)
        return self.nbytes_for(self.layout.grid(side, side, self.default_pixels))

    def prepare(self, image, pixels: PixelRange | None = None) -> QwenPrepared:
        """One image through the HF processor (resize within `pixels`, normalise, patchify); thread-safe.
        image: a PIL image or a decode pool's DecodedImage."""
        pixels = pixels or self.default_pixels
        if self.torch_pixels is not None:  # the grid from the size; the rest on the device
            grid = self.layout.grid(image.height, image.width, pixels)
            return QwenPrepared(grid, raw=to_uint8_hwc(image, pin_memory=self.device.type == "cuda"))
        pil = image if isinstance(image, Image.Image) else image.to_pil()
        out = self.image_processor(images=[pil.convert("RGB")], return_tensors="pt",
                                   size={"shortest_edge": pixels.min_pixels,
                                         "longest_edge": pixels.max_pixels})
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return QwenPrepared(grid, pixel_values=out["pixel_values"])

    @torch.inference_mode()
    def encode_prepared(self, prepared: Sequence[QwenPrepared],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over every prepared image at once; one [tokens, hidden] tensor per image."""
        if not prepared:
            return []
        pixels = torch.cat([self._rows(p) for p in prepared]).to(self.dtype)
        grids = [p.grid for p in prepared]
        rows = self.tower(pixels, grids)
        with self._count_lock:
            self.calls += 1
            self.images_encoded += len(prepared)
        return list(rows.split([self.layout.num_tokens(g) for g in grids]))

    def _rows(self, prepared: QwenPrepared) -> torch.Tensor:
        """One image's patch rows on the device (fp32)."""
        if prepared.raw is None:
            return prepared.pixel_values.to(self.device, non_blocking=True)
        image = prepared.raw.to(self.device, non_blocking=True).permute(2, 0, 1)
        return self.torch_pixels(image, prepared.grid)

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give (0 for "hf")."""
        return 0.0 if self.torch_pixels is None else self.torch_pixels.max_abs_diff()

    def encode(self, images: Sequence[Image.Image], pixels: Sequence[PixelRange | None] | None = None
               ) -> list[torch.Tensor]:
        """One embedding per image (each within its pixel range, or the checkpoint's)."""
        ranges = list(pixels) if pixels is not None else [None] * len(images)
        return self.encode_prepared([self.prepare(i, r) for i, r in zip(images, ranges, strict=True)])

    def capture_graphs(self, max_batch: int) -> bool:
        """No CUDA graphs (every batch has its own sequence length and chunk plan); on CUDA the
        elementwise steps are compiled instead (`compile_elementwise`). Returns False."""
        if self.device.type == "cuda":
            self.compile_elementwise()
        return False

    def compile_elementwise(self) -> bool:
        """Fuse the tower's norms and rotary with torch.compile, checked on a small image; False (and the
        eager steps) when compiling fails."""
        from common.vision.qwen_tower import VisionOps

        self.tower.use_ops(VisionOps.compiled())
        try:
            self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        except Exception as exc:  # noqa: BLE001 - no compiler toolchain, or an inductor bug: run eagerly
            log.warning("torch.compile of the vision tower's elementwise steps failed; eager: %s", exc)
            self.tower.use_ops(VisionOps)
            return False
        return True

    def warm_up(self) -> None:
        """One small image through the tower; checks its rows against the layout's count."""
        (feats,) = self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        expected = self.layout.num_tokens(self.layout.grid(224, 224, self.default_pixels))
        if feats.shape[0] != expected:
            raise ValueError(f"the vision tower gives {feats.shape[0]} rows for a 224x224 image, the layout "
                             f"{expected}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def make_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, preprocess: str = "auto"):
    """The checkpoint's vision encoder: Qwen3VisionEncoder for Qwen3-VL ([parts, tokens, hidden] per
    image), QwenVisionEncoder for Qwen2.5-VL, else the LLaVA VisionEncoder ([tokens, hidden] each)."""
    from common.qwen_layout import is_qwen_vl
    from common.vision.qwen3_encoder import Qwen3VisionEncoder, is_qwen3_vl

    config = load_config(model_dir)
    if is_qwen3_vl(config):
        return Qwen3VisionEncoder(model_dir, device, dtype, preprocess)
    if is_qwen_vl(config):
        return QwenVisionEncoder(model_dir, device, dtype, preprocess)
    from common.vision.tower import VisionEncoder

    return VisionEncoder(model_dir, device, dtype, preprocess=preprocess)


def takes_pixel_ranges(encoder) -> bool:
    """True for an encoder whose images are resized into a pixel range (the Qwen-VL family): its callers
    pass each image's PixelRange, and its entries have a grid and a size that follows the image."""
    from common.vision.qwen3_encoder import Qwen3VisionEncoder

    return isinstance(encoder, QwenVisionEncoder | Qwen3VisionEncoder)
