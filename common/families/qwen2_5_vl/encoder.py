"""The vision half of a Qwen2.5-VL checkpoint: image processor and tower, with VisionEncoder's interface.

An image's rows depend on its size: `prepare` resizes it within its pixel range (the checkpoint's
min/max pixels, or a request's narrower range) with the checkpoint's Hugging Face image processor (PIL
backend: exact, and no torchvision needed), and `encode_prepared` runs several prepared images through
the tower in one forward (tower.py here), returning one [tokens, hidden] tensor each. What the Qwen-VL
encoders share is in encoder_base.py here (Qwen3-VL's encoder builds on it too).
"""

from __future__ import annotations

import torch

from common.checkpoint import CheckpointError
from common.families.qwen2_5_vl.encoder_base import QwenFamilyEncoder, load_qwen_image_processor
from common.families.qwen2_5_vl.tower import VisionOps, load_qwen_tower

__all__ = ["QwenVisionEncoder", "load_qwen_image_processor"]


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

