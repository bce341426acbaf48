"""Images to Phi-4-multimodal image embeddings, [num_tokens, text hidden] per image (num_tokens follows
each image's size).

Preprocessing is pixels.py's HD transform (HF's processor needs torchvision; this one is the same ops on
torch alone): on the host in `prepare` ("hf": the processor's bytes exactly), or on the device in
`encode_prepared` ("torch": `prepare` only copies the pixels into a pinned uint8 tensor; the resize then
runs in float rather than torchvision's native uint8 kernel, within `pixel_tolerance`); "auto" is
"torch" on CUDA in half precision, where the tower's own rounding is far larger. The tower, compression,
separators and projector are embedder.py's. Thread-safety as the other encoders': `prepare` on any
thread, `encode_prepared` from one at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import model_fingerprint
from common.families.encoder import VisionEncoder
from common.families.phi4mm.embedder import load_phi4_embedder
from common.families.phi4mm.layout import Phi4ImageLayout
from common.families.phi4mm.pixels import Phi4Pixels, hd_transform, hd_transform_uint8
from common.image_geometry import ImageSettings
from common.images import to_rgb
from common.vision.pixels import to_uint8_hwc


class Phi4VisionEncoder(VisionEncoder):
    """The image half of a Phi-4-multimodal checkpoint (SigLIP at 448 px crops, 2x2 compression,
    separators, projector); the language model and the audio encoder are never read. preprocess: "hf"
    (the HD transform on the host), "torch" (on the device) or "auto" (the module docstring)."""

    # Each image's size decides its crops; no request-chosen pixel range (dynamic_hd is the checkpoint's).
    takes_pixel_ranges = False
    # ...but its rows follow that size: the encoder service sizes each image's entry from its header
    # (VisionEncoder.image_nbytes) and keeps its grid with the entry (for hash-only asks).
    rows_follow_size = True

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        config = self._open_checkpoint(model_dir, device, dtype, preprocess)
        # Before any weight is read: a configuration we cannot serve fails here, with the reason.
        self.layout = Phi4ImageLayout.from_checkpoint(self.model_dir, config)
        # The HD settings change the crops but live outside config.json: in the hash too (the decoder's
        # input processor appends the same layout.hash_key).
        self.fingerprint = model_fingerprint(self.model_dir) + self.layout.hash_key
        self.hidden_size = int(config["hidden_size"])
        self.embedder = load_phi4_embedder(self.model_dir, config, self.device, dtype)
        self.preprocess_mode = "torch" if self._on_device(preprocess) else "hf"

    def nbytes_for(self, grid: Sequence[int]) -> int:
        """Bytes of the embedding of an image of this (1, rows, cols) grid in the output dtype."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.layout.num_tokens(grid) * self.hidden_size * size

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of the largest image's embedding (dynamic_hd crops): what the cache must be able to hold."""
        return self.nbytes_for(self.layout.largest_grid)

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give: 0 on the host; on the device
        two levels of 255 (the float resize's rounding, then the bicubic global view), normalised."""
        if self.preprocess_mode == "hf":
            return 0.0
        return 2.0 / (255.0 * min(self.layout.settings.image_std))

    def prepare(self, image, settings: ImageSettings | None = None) -> Phi4Pixels | torch.Tensor:
        """Thread-safe (settings: none, each image's size decides its crops).
        "hf": one image's crops, masks (fp32, CPU) and grid; "torch": its [H, W, 3] uint8
        pixels, one copy (into pinned memory on CUDA), for encode_prepared to transform on the device.
        image: a PIL image or a decode pool's DecodedImage (RGB already, read in place)."""
        if self.preprocess_mode == "hf":
            pil = image if isinstance(image, Image.Image) else image.to_pil()
            return hd_transform(pil, self.layout.settings)
        if isinstance(image, Image.Image):
            image = to_rgb(image)  # transparency onto white, as the processor does
        return to_uint8_hwc(image, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def encode_prepared(self, prepared: Sequence[Phi4Pixels | torch.Tensor],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """The tower over prepared images at once; one [num_tokens, hidden] tensor each."""
        settings = self.layout.settings
        items = [p if isinstance(p, Phi4Pixels) else  # [H, W, 3] uint8: the transform on the device
                 hd_transform_uint8(p.to(self.device, non_blocking=True).permute(2, 0, 1), settings)
                 for p in prepared]
        feats = self.embedder(items)
        self._count(len(feats))
        return feats

    def encode(self, images: Sequence[Image.Image], settings: Sequence[ImageSettings | None] | None = None
               ) -> list[torch.Tensor]:
        """One [num_tokens, hidden] tensor per image, on the encoder's device (settings: none)."""
        return self.encode_prepared([self.prepare(image) for image in images])

    def warm_up(self) -> None:
        """One dummy image through the tower; checks its rows against the layout's count."""
        (feats,) = self.encode([Image.new("RGB", (448, 448), (127, 127, 127))])
        expected = (self.layout.tokens_for_size(448, 448), self.hidden_size)
        if tuple(feats.shape) != expected:
            raise ValueError(f"the vision tower gives {tuple(feats.shape)} for a 448 px image, the layout "
                             f"{expected}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
