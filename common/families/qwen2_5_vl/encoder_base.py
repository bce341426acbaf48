"""What the Qwen-VL vision encoders share (Qwen2.5-VL: encoder.py here; Qwen3-VL:
common/families/qwen3_vl/encoder.py): the checkpoint's layout and image processor, preparing images (HF's
processor, or uint8 pixels for the device-side one), running several through the tower at once, sizes in
bytes, the compiled elementwise steps and the warm-up. A subclass names its tower and what it returns.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import model_fingerprint
from common.families.encoder import VisionEncoder
from common.families.qwen2_5_vl.layout import read_qwen_layout
from common.families.qwen2_5_vl.pixels import QwenTorchPixels
from common.image_geometry import PixelRange
from common.video.patches import frames_to_rows
from common.vision.pixels import to_uint8_hwc
from common.vision.prepared import PreparedGrid

log = logging.getLogger(__name__)


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


def graph_chunks(prepared: Sequence[PreparedGrid], max_patches: int | None) -> list[Sequence[PreparedGrid]]:
    """prepared in consecutive runs of at most max_patches patch rows each (an image larger than that
    alone); None: one run. A demand batch larger than the graphs capture (SignatureGraphs.max_patches)
    then replays them run by run, each launch asynchronous, instead of running eagerly: planning on the
    host and about 400 launches a forward."""
    if max_patches is None:
        return [prepared]
    runs: list[Sequence[PreparedGrid]] = []
    start, rows = 0, 0
    for i, p in enumerate(prepared):
        n = math.prod(p.grid)
        if i > start and rows + n > max_patches:
            runs.append(prepared[start:i])
            start, rows = i, 0
        rows += n
    runs.append(prepared[start:])
    return runs


class QwenFamilyEncoder(VisionEncoder):
    """Images to one Qwen-VL model's image embeddings, one tensor per image whose rows follow its grid.

    Thread-safety as VisionEncoder: `prepare` on any thread; `encode_prepared` from one thread at a time.
    Subclasses set `eager_ops` (the tower's elementwise ops class, with `.compiled()`) and implement
    `_check_model`, `_load_tower`, `_merger_width` and `_per_image`.
    """

    graphs = None  # SignatureGraphs once capture_graphs() is called on CUDA
    takes_pixel_ranges = True  # images resized into a PixelRange
    eager_ops: type

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        config = self._open_checkpoint(model_dir, device, dtype, preprocess)
        self._check_model(config)
        self.layout = read_qwen_layout(self.model_dir, config)
        # videos: sampling, resize, normalisation (the layout's rules)
        self.video_config = self.layout.video_config(self.model_dir)
        # as the decoder hashes images (the layout adds no key: this fingerprint also keys videos, which
        # the decoder hashes under the checkpoint's alone)
        self.fingerprint = model_fingerprint(self.model_dir) + self.layout.hash_key
        self.hidden_size = int((config.get("text_config") or config)["hidden_size"])
        self.tower = self._load_tower(config["vision_config"])
        if self._merger_width() != self.hidden_size:
            raise ValueError("the vision merger's output width differs from the language model's hidden size")
        self.parts = int(getattr(self.tower, "parts", 1))  # tensors per image row (Qwen3-VL: DeepStack)
        self.image_processor = load_qwen_image_processor(self.model_dir)
        # "auto": on the device in half precision (the tower's rounding dwarfs a pixel level), else HF's
        # processor (fp32 keeps bit parity with HF, the oracle tests' contract).
        on_device = self._on_device(preprocess)
        self.preprocess_mode = "torch" if on_device else "hf"
        self.torch_pixels = QwenTorchPixels(self.image_processor) if on_device else None
        self.default_pixels = PixelRange(self.layout.min_pixels, self.layout.max_pixels)
        # On a GPU the elementwise steps run as Triton kernels (common/kernels/vision_fused_ops.py); the
        # CPU keeps HF's exact eager steps.
        self.fused_ops = self.device.type == "cuda" and self.use_fused_ops()

    # -- what a model names ------------------------------------------------------------------------
    def _check_model(self, config: dict) -> None:
        """CheckpointError unless config.json is this encoder's model."""
        raise NotImplementedError

    def _load_tower(self, vision_config: dict) -> torch.nn.Module:
        raise NotImplementedError

    def _merger_width(self) -> int:
        raise NotImplementedError

    def _per_image(self, features, sizes: list[int]) -> list[torch.Tensor]:
        """The tower's output over a batch split into one tensor per image of `sizes` rows."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------
    def embedding_shape(self, rows: int) -> tuple[int, ...]:
        """The tensor shape of an image of `rows` tokens: [rows, hidden], or [parts, rows, hidden]."""
        return (rows, self.hidden_size) if self.parts == 1 else (self.parts, rows, self.hidden_size)

    def nbytes_for(self, grid: Sequence[int]) -> int:
        """Bytes of the embedding (every part) of an image of this grid, in the output dtype."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.parts * self.layout.num_tokens(grid) * self.hidden_size * itemsize

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of the largest image's embedding (max_pixels): what the cache must be able to hold."""
        side = int(self.layout.max_pixels ** 0.5)
        return self.nbytes_for(self.layout.grid(side, side, self.default_pixels))

    def prepare(self, image, settings: PixelRange | None = None) -> PreparedGrid:
        """One image through the HF processor (resize within `pixels`, normalise, patchify), or only its
        grid and uint8 pixels for the device-side processor; thread-safe. image: a PIL image or a decode
        pool's DecodedImage."""
        pixels = settings or self.default_pixels
        if self.torch_pixels is not None:  # the grid from the size; the rest on the device
            grid = self.layout.grid(image.height, image.width, pixels)
            return PreparedGrid(grid, raw=to_uint8_hwc(image, pin_memory=self.device.type == "cuda"))
        pil = image if isinstance(image, Image.Image) else image.to_pil()
        size = {"shortest_edge": pixels.min_pixels, "longest_edge": pixels.max_pixels}
        out = self.image_processor(images=[pil.convert("RGB")], return_tensors="pt", size=size)
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return PreparedGrid(grid, pixel_values=out["pixel_values"])

    @torch.inference_mode()
    def encode_prepared(self, prepared: Sequence[PreparedGrid],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over every prepared image (or video) at once; one embedding_shape tensor each."""
        if not prepared:
            return []
        graphs = self.graphs if use_graphs else None
        tower = graphs if graphs is not None else self.tower
        out: list[torch.Tensor] = []
        for chunk in graph_chunks(prepared, None if graphs is None else graphs.max_patches):
            pixels = torch.cat([self._rows(p) for p in chunk]).to(self.dtype)
            grids = [p.grid for p in chunk]
            out += self._per_image(tower(pixels, grids), [self.layout.num_tokens(g) for g in grids])
        self._count(len(prepared))
        return out

    def launch_groups(self, prepared: Sequence[PreparedGrid], use_graphs: bool = False
                      ) -> list[Sequence[PreparedGrid]]:
        """The runs the graphs capture (graph_chunks) for a graphed batch; one run otherwise."""
        graphs = self.graphs if use_graphs else None
        return graph_chunks(prepared, None if graphs is None else graphs.max_patches)

    @property
    def patches_videos_on_device(self) -> bool:
        """Whether a video may come as its sampled frames (PreparedGrid.frames), patched on the device: where
        images are (preprocess "torch"), so the host neither patches nor copies fp32 rows (4x the bytes)."""
        return self.torch_pixels is not None

    def _rows(self, prepared: PreparedGrid) -> torch.Tensor:
        """One image's (or video's) patch rows on the device (fp32)."""
        if prepared.frames is not None:
            return frames_to_rows(prepared.frames, prepared.grid, self.video_config, self.device)
        if prepared.raw is None:
            return prepared.pixel_values.to(self.device, non_blocking=True)
        image = prepared.raw.to(self.device, non_blocking=True).permute(2, 0, 1)
        return self.torch_pixels(image, prepared.grid)

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give (0 for "hf")."""
        return 0.0 if self.torch_pixels is None else self.torch_pixels.max_abs_diff()

    def encode(self, images: Sequence[Image.Image], settings: Sequence[PixelRange | None] | None = None
               ) -> list[torch.Tensor]:
        """One embedding per image (each within its pixel range, or the checkpoint's)."""
        ranges = list(settings) if settings is not None else [None] * len(images)
        return self.encode_prepared([self.prepare(i, r) for i, r in zip(images, ranges, strict=True)])

    def quantize(self, scheme: str) -> list[str]:
        """FP8 weights and per-token activation scales in the tower's linear layers (common/vision/fp8.py)."""
        if scheme != "fp8":
            return super().quantize(scheme)
        from common.vision.fp8 import quantize_tower

        if self.graphs is not None and len(self.graphs):
            raise RuntimeError("quantize the vision tower before its CUDA graphs are captured")
        names = quantize_tower(self.tower)
        log.info("vision tower: %d linear layers in FP8", len(names))
        return names

    def capture_graphs(self, max_batch: int) -> bool:
        """On CUDA, replay demand batches (`encode_prepared(use_graphs=True)`) from CUDA graphs, one per
        batch signature seen twice (common/vision/tower_graphs.py); the elementwise steps already run as
        Triton kernels and attention as one call per block. False on a CPU (HF's exact eager path)."""
        if self.device.type != "cuda":
            return False
        from common.vision.tower_graphs import SignatureGraphs

        self.graphs = SignatureGraphs(self.tower)
        return True

    def use_fused_ops(self, tolerance: float = 2e-2) -> bool:
        """Run the tower's elementwise steps as Triton kernels (`eager_ops.fused()`), checked against the
        eager steps on a small image (relative error under `tolerance`); False (and the eager steps)
        when they fail or disagree."""
        probe = [Image.new("RGB", (224, 224), (127, 127, 127))]
        probe[0].putpixel((5, 7), (255, 0, 0))  # not uniform: every row differs after attention
        self.tower.use_ops(self.eager_ops)
        try:
            (want,) = self.encode(probe)
            self.tower.use_ops(self.eager_ops.fused())
            (got,) = self.encode(probe)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        except Exception as exc:  # noqa: BLE001 - no Triton for this GPU or build: the eager steps run
            log.warning("the vision tower's Triton kernels failed; eager steps: %s", exc)
            self.tower.use_ops(self.eager_ops)
            return False
        if not err < tolerance:
            log.warning("the vision tower's Triton kernels disagree with the eager steps (relative error "
                        "%.3g); eager steps", err)
            self.tower.use_ops(self.eager_ops)
            return False
        return True

    def compile_elementwise(self) -> bool:
        """Fuse the tower's elementwise steps (norms, rotary) with torch.compile, checked on a small
        image; False (and the eager steps) when compiling fails."""
        self.tower.use_ops(self.eager_ops.compiled())
        try:
            self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        except Exception as exc:  # noqa: BLE001 - no compiler toolchain, or an inductor bug: run eagerly
            log.warning("torch.compile of the vision tower's elementwise steps failed; eager: %s", exc)
            self.tower.use_ops(self.eager_ops)
            return False
        return True

    def warm_up(self) -> None:
        """One small image through the tower; checks its shape against the layout's token count."""
        (feats,) = self.encode([Image.new("RGB", (224, 224), (127, 127, 127))])
        rows = self.layout.num_tokens(self.layout.grid(224, 224, self.default_pixels))
        expected = self.embedding_shape(rows)
        if tuple(feats.shape) != expected:
            raise ValueError(f"the vision tower gives {tuple(feats.shape)} for a 224x224 image, the layout "
                             f"{expected}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
