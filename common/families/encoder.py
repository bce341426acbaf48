"""The vision encoder a family declares: images (and, for a family that takes them, videos) to the
embedding rows its language model reads in place of the placeholders.

The encoder service, the decoder's in-process source and the benchmarks type against this interface and
branch on its capabilities, never on whose encoder it is. A family's implementation lives in its folder
(common/families/<name>/encoder.py) and is named by its ModelFamily's `vision_encoder` reference; it is
built as `cls(model_dir, device, dtype, preprocess=...)`. The shared start of every constructor (the
preprocess mode checked, the checkpoint's config read, the counters) is `_open_checkpoint`.

Thread-safety: `prepare` may run on any thread (the service's preprocessing pools); `encode_prepared` from
one thread at a time; `calls` and `images_encoded` count tower invocations (tests use them to prove that
cache hits run no vision work).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from common.checkpoint import load_config
from common.families.layout import NO_PAN_AND_SCAN, ImageLayout
from common.image_geometry import CropChoice, Grid, ImageGeometryError, ImageSettings
from common.vision import PREPROCESS_MODES


class VisionEncoder(ABC):
    """One checkpoint's vision tower (and projector) behind the calls the services make.

    Capabilities are class data, so that callers branch on what an encoder does, never on whose it is.
    """

    # each image is resized into a PixelRange a request may narrow (dynamic resolution): its entry has a
    # grid and a size that follow the image
    takes_pixel_ranges: ClassVar[bool] = False
    # ...or, without a pixel range, the image's own size decides its rows (Phi-4-MM's crops): the service
    # sizes each entry from the image's header and keeps its grid
    rows_follow_size: ClassVar[bool] = False
    # the device-side tower graphs once capture_graphs succeeds (batch_size(n), len()); None: eager
    graphs: Any = None
    # the tower's elementwise steps run as fused (Triton) kernels
    fused_ops: bool = False
    # the family's video rules for this checkpoint (its layout's `video`); None: the model takes no video
    video_config: Any = None

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    layout: ImageLayout
    fingerprint: str  # the checkpoint's content fingerprint (and settings that change an embedding)
    hidden_size: int  # the language model's hidden size: each embedding row's width
    preprocess_mode: str  # "hf" (host, HF's processor exactly) or "torch" (on the device)
    calls: int
    images_encoded: int

    def _open_checkpoint(self, model_dir: str | Path, device: str | torch.device, dtype: torch.dtype,
                         preprocess: str) -> dict[str, Any]:
        """The start every constructor shares: the preprocess mode checked, the paths, device and dtype
        kept, the counters zeroed; returns the checkpoint's config.json."""
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, not {preprocess!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.calls = 0
        self.images_encoded = 0
        self._count_lock = threading.Lock()
        return load_config(self.model_dir)

    def _count(self, images: int) -> None:
        """One tower invocation over `images` images (thread-safe)."""
        with self._count_lock:
            self.calls += 1
            self.images_encoded += images

    def _on_device(self, preprocess: str) -> bool:
        """Whether `preprocess` prepares on the device: "torch", or "auto" on CUDA in half precision (where
        the tower's own rounding dwarfs a pixel level; fp32 keeps bit parity with HF's processor)."""
        return preprocess == "torch" or (preprocess == "auto" and self.device.type == "cuda"
                                         and self.dtype != torch.float32)

    # -- preprocessing and the tower ---------------------------------------------------------------
    @abstractmethod
    def prepare(self, image: Any, settings: ImageSettings | None = None) -> Any:
        """One image's host-side preprocessing; thread-safe. image: a PIL image or a decode pool's
        DecodedImage; settings: its image_settings (None: the checkpoint's)."""

    @abstractmethod
    def encode_prepared(self, prepared: Sequence[Any], use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over prepared images (or videos) at once; one embedding tensor each, on the device
        (use_graphs: replay the captured graphs where there are some)."""

    @abstractmethod
    def encode(self, images: Sequence[Any], settings: Sequence[ImageSettings | None] | None = None
               ) -> list[torch.Tensor]:
        """One embedding per image (each with its settings, or the checkpoint's)."""

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give (0: HF's exactly)."""
        return 0.0

    @property
    def patches_videos_on_device(self) -> bool:
        """Whether a video may come as its sampled frames (PreparedGrid.frames), patched on the device."""
        return False

    # -- sizes -------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def embedding_nbytes(self) -> int:
        """Bytes of one image's embedding where its size is not known (fixed, or the largest): what the
        cache must be able to hold."""

    def nbytes_for(self, grid: Grid) -> int:
        """Bytes of the embedding of an image (or video) of this grid, in the output dtype."""
        raise ImageGeometryError("this model's images have no grid")

    def image_settings(self, min_pixels: int = 0, max_pixels: int = 0,
                       pan_and_scan: bool | None = None) -> ImageSettings | None:
        """One image's settings from an ImageInput's options: a pixel-range encoder's range (within the
        model's), else None. ImageGeometryError for pan_and_scan true on a model without crops, or a range
        the model refuses."""
        if pan_and_scan:
            raise ImageGeometryError(NO_PAN_AND_SCAN)
        if self.takes_pixel_ranges:
            return self.layout.pixel_range(min_pixels, max_pixels)
        return None

    def image_nbytes(self, height: int, width: int, settings: ImageSettings | None = None) -> int:
        """Bytes of the embedding of a height x width image with these settings: from its grid where the
        rows follow the size (a pixel range's resize; the crops of its shape; crops a CropChoice turns
        on), else embedding_nbytes. ImageGeometryError for a size the model cannot take."""
        if self.takes_pixel_ranges or self.rows_follow_size or isinstance(settings, CropChoice):
            return self.nbytes_for(self.layout.grid(height, width, settings))
        return self.embedding_nbytes

    def launch_groups(self, prepared: Sequence[Any], use_graphs: bool = False) -> list[Sequence[Any]]:
        """prepared split into consecutive runs, in order, that encode_prepared runs as one forward each
        (the worker hands each run's rows over before launching the next); default: one run."""
        return [prepared]

    # -- start-up ----------------------------------------------------------------------------------
    def quantize(self, scheme: str) -> list[str]:
        """Quantize the tower's weights in place (`--vision-quantization`; common/vision/fp8.py), before
        capture_graphs and warm_up; the layers quantized. "none" changes nothing; a scheme the family's
        tower does not have is a ValueError naming it."""
        if scheme == "none":
            return []
        raise ValueError(f"{type(self).__name__} has no {scheme!r} vision tower (--vision-quantization none)")

    def capture_graphs(self, max_batch: int) -> bool:
        """Capture device graphs for batches up to max_batch; False (and eager forwards) where there are
        none (off CUDA, a capture that failed, a tower that has none)."""
        return False

    @abstractmethod
    def warm_up(self) -> None:
        """One dummy image through the tower (first-call allocations, kernels, lazy imports), checked
        against the layout's shape for it."""
