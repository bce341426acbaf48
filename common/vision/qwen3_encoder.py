"""The vision half of a Qwen3-VL checkpoint: image processor and tower, in the shape of QwenVisionEncoder.

Qwen3-VL lays images out as Qwen2.5-VL does (Qwen2-VL's image processor and smart_resize, here with
16-px patches merged 2x2, so sides are multiples of 32 px, and 65536 to 16777216 pixels per image), so
the geometry is common/qwen_layout.py's. What differs is the output: each image gives a [parts, tokens,
hidden] tensor, the merged features first and then one DeepStack level each (the language model adds
level k to the image tokens' hidden states after its decoder layer k).

`make_vision_encoder` picks it for `qwen3_vl` checkpoints: the encoder service caches each image's
tensor as one entry (EmbeddingRef.shape = [parts, rows, hidden]) and the decoder's in-process source
returns it as is.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import CheckpointError, load_config, model_fingerprint
from common.qwen_layout import PixelRange, read_qwen_layout
from common.video.config import load_qwen_video_config
from common.vision import PREPROCESS_MODES
from common.vision.pixels import to_uint8_hwc
from common.vision.qwen3_tower import load_qwen3_tower
from common.vision.qwen_encoder import QwenPrepared, load_qwen_image_processor
from common.vision.qwen_pixels import QwenTorchPixels

QWEN3_MODEL_TYPES = ("qwen3_vl",)

log = logging.getLogger(__name__)


def is_qwen3_vl(config: dict) -> bool:
    """True for a (dense) Qwen3-VL checkpoint's config.json."""
    return config.get("model_type") in QWEN3_MODEL_TYPES


class Qwen3VisionEncoder:
    """Images to Qwen3-VL image embeddings, [parts, tokens, text hidden] per image (tokens from its grid,
    parts = 1 + DeepStack levels).

    Thread-safety as QwenVisionEncoder: `prepare` on any thread; `encode_prepared` from one at a time.
    """

    graphs = None  # shapes vary per batch: no CUDA graphs

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, not {preprocess!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        config = load_config(self.model_dir)
        if not is_qwen3_vl(config):
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen3-VL checkpoint")
        self.layout = read_qwen_layout(self.model_dir, config)
        self.video_config = load_qwen_video_config(self.model_dir)  # videos: sampling, resize, normalisation
        self.fingerprint = model_fingerprint(self.model_dir)
        self.hidden_size = int((config.get("text_config") or config)["hidden_size"])
        self.tower = load_qwen3_tower(self.model_dir, config["vision_config"], self.device, dtype)
        if self.tower.merger.linear_fc2.out_features != self.hidden_size:
            raise ValueError("the vision merger's output width differs from the language model's hidden size")
        self.parts = self.tower.parts
        self.image_processor = load_qwen_image_processor(self.model_dir)
        # As QwenVisionEncoder: on the device in half precision, else HF's processor (exact in fp32).
        on_device = preprocess == "torch" or (preprocess == "auto" and self.device.type == "cuda"
                                              and dtype != torch.float32)
        self.preprocess_mode = "torch" if on_device else "hf"
        self.torch_pixels = QwenTorchPixels(self.image_processor) if on_device else None
        self.default_pixels = PixelRange(self.layout.min_pixels, self.layout.max_pixels)
        self.calls = 0
        self.images_encoded = 0
        self._count_lock = threading.Lock()

    def nbytes_for(self, grid: Sequence[int]) -> int:
        """Bytes of the embedding (every part) of an image of this grid, in the output dtype."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.parts * self.layout.num_tokens(grid) * self.hidden_size * itemsize

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of the largest image's embedding (max_pixels): what the cache must be able to hold."""
        side = int(self.layout.max_pixels ** 0.5)
        return self.nbytes_for(self.layout.grid(side, side, self.default_pixels))

    def prepare(self, image, pixels: PixelRange | None = None) -> QwenPrepared:
        """One image through the HF processor (resize within `pixels`, normalise, patchify), or only its
        grid and uint8 pixels for the device-side processor; thread-safe. image: a PIL image or a decode
        pool's DecodedImage."""
        pixels = pixels or self.default_pixels
        if self.torch_pixels is not None:
            grid = self.layout.grid(image.height, image.width, pixels)
            return QwenPrepared(grid, raw=to_uint8_hwc(image, pin_memory=self.device.type == "cuda"))
        pil = image if isinstance(image, Image.Image) else image.to_pil()
        size = {"shortest_edge": pixels.min_pixels, "longest_edge": pixels.max_pixels}
        out = self.image_processor(images=[pil.convert("RGB")], return_tensors="pt", size=size)
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return QwenPrepared(grid, pixel_values=out["pixel_values"])

    @torch.inference_mode()
    def encode_prepared(self, prepared: Sequence[QwenPrepared],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over every prepared image at once; one [parts, tokens, hidden] tensor per image."""
        if not prepared:
            return []
        pixels = torch.cat([self._rows(p) for p in prepared]).to(self.dtype)
        grids = [p.grid for p in prepared]
        features = self.tower(pixels, grids)
        with self._count_lock:
            self.calls += 1
            self.images_encoded += len(prepared)
        return features.split([self.layout.num_tokens(g) for g in grids])

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
        """One [parts, tokens, hidden] embedding per image (each within its pixel range, or the
        checkpoint's)."""
        ranges = list(pixels) if pixels is not None else [None] * len(images)
        return self.encode_prepared([self.prepare(i, r) for i, r in zip(images, ranges, strict=True)])

    def capture_graphs(self, max_batch: int) -> bool:
        """No CUDA graphs (every batch has its own sequence length and chunk plan), and, unlike
        QwenVisionEncoder, no compiled elementwise steps either: on the H200 (Qwen3-VL-8B shapes, bf16,
        1024x1024 images) `compile_elementwise` made the tower slower, 30.9 against 51.6 images/s at
        batch 8 (docs/benchmarks/h200-2026-12-01-run14-qwen3.json). Returns False."""
        return False

    def compile_elementwise(self) -> bool:
        """Fuse the tower's rotary, LayerNorms and residual adds with torch.compile, checked on a small
        image; False (and the eager steps) when compiling fails."""
        from common.vision.qwen3_tower import Qwen3VisionOps

        self.tower.use_ops(Qwen3VisionOps.compiled())
        try:
            self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        except Exception as exc:  # noqa: BLE001 - no compiler toolchain, or an inductor bug: run eagerly
            log.warning("torch.compile of the vision tower's elementwise steps failed; eager: %s", exc)
            self.tower.use_ops(Qwen3VisionOps)
            return False
        return True

    def warm_up(self) -> None:
        """One small image through the tower; checks its shape against the layout's token count."""
        (feats,) = self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        expected = (self.parts, self.layout.num_tokens(self.layout.grid(224, 224, self.default_pixels)),
                    self.hidden_size)
        if tuple(feats.shape) != expected:
            raise ValueError(f"the vision tower gives {tuple(feats.shape)} for a 224x224 image, the layout "
                             f"{expected}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
