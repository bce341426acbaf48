"""Images to Gemma 3 image embeddings, [mm_tokens_per_image, text hidden] per image; with pan-and-scan
(the image's CropChoice: a request's pan_and_scan, else the checkpoint's do_pan_and_scan),
[(1 + crops) x mm_tokens_per_image, text hidden]: the original's rows, then each crop's, in the order HF's
processor stacks them (get_image_features over its pixel_values).

Preprocessing, as LLaVA's VisionEncoder does it: "hf" runs the checkpoint's HF image processor
(Gemma3ImageProcessorPil: bilinear resize to the tower's square, rescale, normalise) on the host, exact;
"torch" prepares only a uint8 tensor and resizes and normalises on the device (common/vision/pixels.py,
within `pixel_tolerance` of HF's); "auto" is "torch" on CUDA in half precision, else "hf" (fp32 keeps
the bit parity with HF that the oracle tests check). Pan-and-scan images are cut by the HF processor in
every mode (the crops are not reproduced on the device). The tower is tower.py's.
Thread-safety as VisionEncoder's: `prepare` on any thread, `encode_prepared` from one at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import model_fingerprint
from common.families.encoder import VisionEncoder
from common.families.gemma3.layout import Gemma3ImageLayout
from common.families.gemma3.tower import load_gemma3_tower
from common.image_geometry import CropChoice, Grid
from common.vision.pixels import pick_pixel_processor, to_uint8_hwc
from common.vision.prepared import PreparedGrid


def load_gemma3_image_processor(model_dir: str | Path):
    """The checkpoint's Gemma 3 image processor with the PIL backend (no torchvision needed)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil.from_pretrained(str(model_dir), local_files_only=True)


class Gemma3VisionEncoder(VisionEncoder):
    """The vision half of a Gemma 3 checkpoint (SigLIP, pooling, projector); the language model is never
    read. preprocess: "auto", "hf" or "torch" (the module docstring)."""

    takes_pixel_ranges = False  # every image is resized to the tower's square

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        config = self._open_checkpoint(model_dir, device, dtype, preprocess)
        # Before any weight is read: a configuration we cannot serve fails here, with the reason.
        self.layout = Gemma3ImageLayout.from_checkpoint(self.model_dir, config)
        # As the decoder hashes images: the checkpoint (its processor settings, the crop rule's included)
        # and the layout's key; each image's crop choice is added per image (hash_fingerprint(fingerprint,
        # CropChoice)).
        self.fingerprint = model_fingerprint(self.model_dir) + self.layout.hash_key
        self.hidden_size = int(config["text_config"]["hidden_size"])
        self.num_image_tokens = self.layout.mm_tokens_per_image
        self.tower = load_gemma3_tower(self.model_dir, config, self.device, dtype)
        self.image_processor = load_gemma3_image_processor(self.model_dir)
        self.pixel_processor = pick_pixel_processor(preprocess, self.device, dtype, self.image_processor)
        self.preprocess_mode = "hf" if self.pixel_processor is None else "torch"

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give (0 for "hf")."""
        return 0.0 if self.pixel_processor is None else self.pixel_processor.max_abs_diff()

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of one image's embedding in the output dtype where its choice is not given: with the
        checkpoint's pan-and-scan, of the most crops (what the encoder's cache reserves for an image
        before it is cut)."""
        pas = self.layout.pan_and_scan
        return self.nbytes_for((1 + (pas.max_num_crops if pas is not None else 0), 1, 1))

    def nbytes_for(self, grid: Grid) -> int:
        """Bytes of the embedding of an image of this grid ((1 + crops, 1, 1): one block per tower image)."""
        row_bytes = self.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return int(grid[0]) * self.num_image_tokens * row_bytes

    def image_settings(self, min_pixels: int = 0, max_pixels: int = 0,
                       pan_and_scan: bool | None = None) -> CropChoice:
        """An image's crop choice from a request's options (the layout's)."""
        return self.layout.image_settings(min_pixels, max_pixels, pan_and_scan)

    def prepare(self, image, settings: CropChoice | None = None) -> torch.Tensor | PreparedGrid:
        """One image's host-side preprocessing; thread-safe. image: a PIL image or a decode pool's
        DecodedImage; settings: its crop choice (None: the checkpoint's). Without crops, "hf": its pixel
        values (fp32, CPU) [3, S, S]; "torch": a uint8 [H, W, 3] tensor, resized and normalised on the
        device by encode_prepared. With crops (either mode) a PreparedGrid of [1 + crops, 3, S, S] pixel
        values (the original first) and the layout's grid (1 + crops, 1, 1), which the encoder service
        keeps with the cache entry for hash-only lookups."""
        crops = settings if settings is not None else self.layout.crops()
        rule = self.layout.crop_rule
        if (not crops.on or rule is None) and self.preprocess_mode == "torch":
            return to_uint8_hwc(image, pin_memory=self.device.type == "cuda")
        pil = image if isinstance(image, Image.Image) else image.to_pil()
        if not crops.on or rule is None:  # off explicitly: the config's do_pan_and_scan may say on
            return self.image_processor(images=[pil], return_tensors="pt",
                                        do_pan_and_scan=False)["pixel_values"][0]
        out = self.image_processor(images=[pil], return_tensors="pt", **rule.processor_kwargs())
        pixels = out["pixel_values"]
        return PreparedGrid((pixels.shape[0], 1, 1), pixel_values=pixels)

    @torch.inference_mode()
    def encode_prepared(self, prepared: Sequence[torch.Tensor | PreparedGrid],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over prepared images at once; one [tower images x mm_tokens_per_image, hidden] tensor
        each (a pan-and-scan image's crops in one batch with the rest, their rows joined after)."""
        if not prepared:
            return []
        stacks = self._device_pixels(prepared)
        pixels = torch.cat(stacks).to(self.dtype)
        feats = self.graphs(pixels) if use_graphs and self.graphs is not None else self.tower(pixels)
        self._count(len(stacks))
        parts = feats.split([s.shape[0] for s in stacks])
        return [part.reshape(-1, part.shape[-1]) for part in parts]

    def _device_pixels(self, prepared: Sequence[torch.Tensor | PreparedGrid]) -> list[torch.Tensor]:
        """Each prepared image's fp32 pixel values [tower images, 3, S, S] on the device; the uint8 ones
        (torch mode) resized and normalised there together."""
        raw = [i for i, p in enumerate(prepared) if isinstance(p, torch.Tensor) and p.dtype == torch.uint8]
        done: dict[int, torch.Tensor] = {}
        if raw:
            assert self.pixel_processor is not None, "uint8 images come only from prepare in torch mode"
            pixels = self.pixel_processor([prepared[i].to(self.device, non_blocking=True).permute(2, 0, 1)
                                           for i in raw])
            done = {i: pixels[j:j + 1] for j, i in enumerate(raw)}
        host = {i: p.pixel_values if isinstance(p, PreparedGrid) else p.unsqueeze(0)
                for i, p in enumerate(prepared) if i not in done}
        return [done[i] if i in done else host[i].to(self.device, non_blocking=True)
                for i in range(len(prepared))]

    def encode(self, images: Sequence[Image.Image],
               settings: Sequence[CropChoice | None] | None = None) -> list[torch.Tensor]:
        """One [tower images x mm_tokens_per_image, hidden] tensor per image, on the encoder's device;
        settings: each image's crop choice (default: the checkpoint's)."""
        choices = list(settings) if settings is not None else [None] * len(images)
        return self.encode_prepared([self.prepare(im, c) for im, c in zip(images, choices, strict=True)])

    def capture_graphs(self, max_batch: int) -> bool:
        """Capture CUDA graphs of the tower (SigLIP + pooling + projector) for batches of tower images up
        to max_batch (common/vision/graphs.py: every image is the tower's square, so one sample shape);
        False (and eager forwards) off CUDA or when capturing fails. A pan-and-scan image counts as its
        1 + crops tower images."""
        if self.device.type != "cuda":
            return False
        from common.vision.graphs import capture_tower_graphs

        side = self.layout.image_size
        self.graphs = capture_tower_graphs(self.tower, (3, side, side), self.dtype, self.device, max_batch,
                                           "Gemma 3 tower")
        return self.graphs is not None

    def warm_up(self) -> None:
        """One dummy image through the tower; checks its rows against the layout's count."""
        side = self.layout.image_size
        (feats,) = self.encode([Image.new("RGB", (side, side), (127, 127, 127))])
        if tuple(feats.shape) != (self.num_image_tokens, self.hidden_size):
            raise ValueError(f"the vision tower gives {tuple(feats.shape)} per image, the layout "
                             f"{(self.num_image_tokens, self.hidden_size)}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
