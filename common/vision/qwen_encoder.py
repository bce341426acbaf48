"""The vision half of a Qwen2.5-VL checkpoint: image processor and tower, with VisionEncoder's interface.

An image's rows depend on its size: `prepare` resizes it within its pixel range (the checkpoint's
min/max pixels, or a request's narrower range) with the checkpoint's Hugging Face image processor (PIL
backend: exact, and no torchvision needed), and `encode_prepared` runs several prepared images through
the tower in one forward (common/vision/qwen_tower.py), returning one [tokens, hidden] tensor each. What
the Qwen-VL encoders share is in common/vision/qwen_family.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.checkpoint import CheckpointError, load_config
from common.vision.qwen_family import QwenFamilyEncoder, QwenPrepared, load_qwen_image_processor
from common.vision.qwen_tower import VisionOps, load_qwen_tower

__all__ = ["QwenPrepared", "QwenVisionEncoder", "load_qwen_image_processor", "make_vision_encoder",
           "takes_pixel_ranges"]


class QwenVisionEncoder(QwenFamilyEncoder):
    """Images to Qwen2.5-VL image embeddings, [tokens, text hidden] per image (tokens from its grid)."""

    eager_ops = VisionOps

    def _check_model(self, config: dict) -> None:
        if config.get("model_type") != "qwen2_5_vl":  # Qwen3-VL shares the layout, not the tower
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen2.5-VL checkpoint")

    def _load_tower(self, vision_config: dict) -> torch.nn.Module:
        return load_qwen_tower(self.model_dir, vision_config, self.device, self.dtype)

    def _merger_width(self) -> int:
        return self.tower.merger.mlp[2].out_features

    def _per_image(self, features: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(features.split(sizes))


def make_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, preprocess: str = "auto"):
    """The checkpoint's vision encoder, as its family declares it (common/families/): Qwen3-VL's gives
    [parts, tokens, hidden] per image, Qwen2.5-VL's and LLaVA's [tokens, hidden]."""
    from common.families import family_of

    return family_of(load_config(model_dir)).make_vision_encoder(model_dir, device, dtype, preprocess)


def takes_pixel_ranges(encoder) -> bool:
    """True for an encoder whose images are resized into a pixel range (the Qwen-VL family): its callers
    pass each image's PixelRange, and its entries have a grid and a size that follows the image."""
    return isinstance(encoder, QwenFamilyEncoder)
