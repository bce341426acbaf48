"""The vision half of a LLaVA checkpoint: image processor, vision tower and projector.

Only the vision tower and projector tensors are read from the checkpoint; the language model never
leaves the disk. The forward pass reproduces `LlavaForConditionalGeneration.get_image_features`: the
hidden states of `vision_feature_layer` (one layer or several, concatenated), the first row (CLIP's CLS
token) dropped under the "default" select strategy, then the projector. The number of rows per image
comes from common.families.llava.layout, the module the decoder counts placeholders with. Layers after the
deepest selected one do not change the result, so they are not built (a -2 feature layer saves one CLIP
layer per image).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import load_tensors, model_fingerprint
from common.families.encoder import VisionEncoder
from common.families.llava.layout import UnsupportedImageConfigError, load_image_token_layout
from common.image_geometry import ImageSettings
from common.vision.image_processor import load_image_processor
from common.vision.pixels import pick_pixel_processor, to_uint8_hwc

log = logging.getLogger(__name__)

# Checkpoint layouts seen in the wild: "vision_tower.*" (transformers 5 CLIPVisionModel),
# "vision_tower.vision_model.*" (llava-1.5-hf), "model.vision_tower.*" (LlavaModel-wrapped saves).
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def _strip(name: str, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _feature_layers(layer: int | list[int], num_layers: int) -> list[int]:
    """vision_feature_layer as non-negative indexes into hidden_states (num_layers + 1 entries)."""
    layers = [layer] if isinstance(layer, int) else list(layer)
    out = []
    for idx in layers:
        norm = idx if idx >= 0 else num_layers + 1 + idx
        if not 0 <= norm <= num_layers:
            raise ValueError(f"vision_feature_layer {idx} is outside 0..{num_layers}")
        out.append(norm)
    return out


def _init_unloaded(core: torch.nn.Module, missing: list[str]) -> None:
    """Give tensors the checkpoint does not hold real values (to_empty left them uninitialised)."""
    for module in core.modules():
        # CLIP/SigLIP embeddings: position_ids = arange(num_positions), a non-persistent buffer.
        ids = getattr(module, "position_ids", None)
        if isinstance(ids, torch.Tensor):
            if not hasattr(module, "num_positions"):
                raise ValueError(f"cannot rebuild position_ids of {type(module).__name__}")
            ids.copy_(torch.arange(module.num_positions).expand_as(ids))
    if any(k.startswith("post_layernorm") for k in missing) and hasattr(core, "post_layernorm"):
        core.post_layernorm.reset_parameters()  # unused by LLaVA features; defined values all the same


class LlavaVisionEncoder(VisionEncoder):
    """Images to LLaVA image features, [num_image_tokens, text_hidden_size] per image.

    Preprocessing is split in two so it can leave the tower's thread: `prepare` (one image, thread-safe,
    run in the worker's preprocessing pool) and `pixels` (a batch of prepared images to pixel values
    on the device). preprocess="hf" prepares with the checkpoint's HF image processor (exact; CPU);
    "torch" prepares only a uint8 tensor and resizes, crops and normalises on the device
    (common/vision/pixels.py, within `pixel_tolerance` of the HF processor); "auto" is "torch" on CUDA in
    half precision (where the tower's own rounding is far larger than a pixel level) when the processor
    can be reproduced, else "hf" (fp32 keeps bit parity with HF's processor, the oracle tests' contract).

    Thread-safety: `encode`/`encode_prepared` may be called from one worker thread at a time; `calls`
    and `images_encoded` count tower invocations (tests use them to prove cache hits run no vision work).
    """

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> None:
        from transformers import AutoConfig, AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        raw = self._open_checkpoint(model_dir, device, dtype, preprocess)
        if "vision_config" not in raw:
            raise ValueError(f"{model_dir} has no vision_config: not a LLaVA checkpoint")
        # Before any weight is read: an image configuration we cannot serve fails here, with the reason.
        self.layout = load_image_token_layout(self.model_dir)
        config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        self.config = config
        # as the decoder hashes images: the checkpoint (processor settings included) and the layout's key
        self.fingerprint = model_fingerprint(self.model_dir) + self.layout.hash_key
        self.select_strategy = self.layout.select_strategy
        num_layers = config.vision_config.num_hidden_layers
        self.feature_layers = _feature_layers(config.vision_feature_layer, num_layers)
        self.multi_layer = not isinstance(config.vision_feature_layer, int)

        vision_cfg = copy.deepcopy(config.vision_config)
        vision_cfg.num_hidden_layers = max(self.feature_layers)
        # Built on the meta device and then given empty storage: a random init of CLIP-L would cost
        # seconds only to be overwritten by the checkpoint.
        with torch.device("meta"):
            tower = AutoModel.from_config(vision_cfg)
            projector = LlavaMultiModalProjector(config)
        tower.to_empty(device="cpu")
        projector.to_empty(device="cpu")
        self._load_weights(tower, projector, vision_cfg.num_hidden_layers)
        self.tower = tower.to(self.device, dtype).eval()
        self.projector = projector.to(self.device, dtype).eval()

        self.image_processor = load_image_processor(self.model_dir)
        self.pixel_processor = pick_pixel_processor(preprocess, self.device, dtype, self.image_processor)
        self.preprocess_mode = "hf" if self.pixel_processor is None else "torch"
        self.graphs = None  # GraphedForward once capture_graphs() succeeds
        self.num_image_tokens = self.layout.num_image_tokens
        self.hidden_size = config.text_config.hidden_size

    @property
    def pixel_tolerance(self) -> float:
        """Largest |pixel value - HF processor's| the preprocessing may give (0 for "hf")."""
        return 0.0 if self.pixel_processor is None else self.pixel_processor.max_abs_diff()

    def _load_weights(self, tower: torch.nn.Module, projector: torch.nn.Module, keep_layers: int) -> None:
        tensors = load_tensors(self.model_dir, _VISION_PREFIXES + _PROJECTOR_PREFIXES)
        vision: dict[str, torch.Tensor] = {}
        proj: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(_PROJECTOR_PREFIXES):
                proj[_strip(name, _PROJECTOR_PREFIXES)] = t
                continue
            key = _strip(_strip(name, _VISION_PREFIXES), ("vision_model.",))
            if key.startswith("encoder.layers."):
                if int(key.split(".")[2]) >= keep_layers:
                    continue  # past the deepest feature layer: never used
            vision[key] = t
        if not vision or not proj:
            raise ValueError(f"{self.model_dir}: no vision tower or projector tensors found")
        # Older transformers wrap the transformer in .vision_model; newer ones do not.
        core = getattr(tower, "vision_model", tower)
        missing, unexpected = core.load_state_dict(vision, strict=False)
        _init_unloaded(core, missing)
        # position_ids is a non-persistent buffer; post_layernorm is unused by LLaVA features.
        missing = [k for k in missing
                   if not k.endswith("position_ids") and not k.startswith("post_layernorm")]
        if missing or unexpected:
            raise ValueError(f"vision tower weights do not match: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        projector.load_state_dict(proj, strict=True)

    @functools.cached_property
    def embedding_nbytes(self) -> int:
        """Bytes of one image's embedding in the output dtype (asked on every Encode: computed once)."""
        return self.num_image_tokens * self.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Pixel values [B, 3, H, W] (fp32, CPU) from the checkpoint's HF image processor (the reference)."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return out["pixel_values"]

    def prepare(self, image, settings: ImageSettings | None = None) -> torch.Tensor:
        """One image's host-side preprocessing (settings: none, every image is the tower's square);
        thread-safe (the HF processor keeps no per-call state, and
        Pillow and numpy drop the GIL in decode, resize and array maths, so threads run it in parallel).
        image: a PIL image, or a decode pool's DecodedImage (raw RGB pixels, read without another copy).

        "hf": its pixel values [3, H, W] fp32. "torch": a uint8 [H, W, 3] tensor for `pixels` (copied to
        the device as it is laid out, made channels-first there).
        """
        if self.preprocess_mode == "hf":
            pil = image if isinstance(image, Image.Image) else image.to_pil()
            return self.image_processor(images=[pil], return_tensors="pt")["pixel_values"][0]
        return to_uint8_hwc(image, pin_memory=self.device.type == "cuda")

    def pixels(self, prepared: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pixel values [B, 3, H, W] on the device from `prepare`'s outputs (torch mode: resized, cropped
        and normalised there). The HF processor works image by image, so stacking its per-image outputs
        gives exactly its batched output."""
        if self.preprocess_mode == "hf":
            return torch.stack(list(prepared))
        return self.pixel_processor([t.to(self.device, non_blocking=True).permute(2, 0, 1) for t in prepared])

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower and projector on device pixels in the model dtype (what CUDA graphs capture)."""
        out = self.tower(pixel_values=pixel_values, output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states
        pool = [hidden[i] for i in self.feature_layers]
        if self.select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        selected = pool[0] if not self.multi_layer else torch.cat(pool, dim=-1)
        return self.projector(selected)

    def capture_graphs(self, max_batch: int) -> bool:
        """Capture CUDA graphs of the tower for batches up to max_batch (common/vision/graphs.py); False
        (and eager forwards) off CUDA or when capturing fails."""
        if self.device.type != "cuda":
            return False
        from common.vision.graphs import capture_tower_graphs

        size = self.config.vision_config.image_size
        sample = (self.config.vision_config.num_channels, size, size)
        self.graphs = capture_tower_graphs(self._features, sample, self.dtype, self.device, max_batch,
                                           "vision tower")
        return self.graphs is not None

    @torch.inference_mode()
    def forward_pixels(self, pixel_values: torch.Tensor, use_graphs: bool = False) -> torch.Tensor:
        """Image features [B, num_image_tokens, text_hidden_size] from pixel values; from the CUDA graphs
        when use_graphs and they were captured (one stream only may replay them: see graphs.py)."""
        pixel_values = pixel_values.to(self.device, self.dtype, non_blocking=True)
        if use_graphs and self.graphs is not None:
            feats = self.graphs(pixel_values)
        else:
            feats = self._features(pixel_values)
        self._count(feats.shape[0])
        return feats

    def encode(self, images: Sequence[Image.Image], settings: Sequence[ImageSettings | None] | None = None
               ) -> list[torch.Tensor]:
        """One [num_image_tokens, text_hidden_size] tensor per image, on the encoder's device (settings:
        none, as for prepare)."""
        return self.encode_prepared([self.prepare(image) for image in images])

    def encode_prepared(self, prepared: Sequence[torch.Tensor],
                        use_graphs: bool = False) -> list[torch.Tensor]:
        """`encode` for images already through `prepare` (use_graphs: see forward_pixels)."""
        if not prepared:
            return []
        return list(self.forward_pixels(self.pixels(prepared), use_graphs).unbind(0))

    def warm_up(self) -> None:
        """Run one dummy image through the tower (first-call allocations, kernels, lazy imports) and
        check that it gives the promised number of rows."""
        size = self.config.vision_config.image_size
        (feats,) = self.encode([Image.new("RGB", (size, size), (127, 127, 127))])
        if feats.shape[0] != self.num_image_tokens:
            raise UnsupportedImageConfigError(
                f"the vision tower gives {feats.shape[0]} rows per image, the processor config "
                f"{self.num_image_tokens} placeholder tokens")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
