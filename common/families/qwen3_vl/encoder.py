"""The vision half of a Qwen3-VL checkpoint: image processor and tower, in the shape of QwenVisionEncoder.

Qwen3-VL lays images out as Qwen2.5-VL does (Qwen2-VL's image processor and smart_resize, here with
16-px patches merged 2x2, so sides are multiples of 32 px, and 65536 to 16777216 pixels per image), so
the geometry is common/families/qwen2_5_vl/layout.py's. What differs is the output: each image gives a
[parts, tokens, hidden] tensor, the merged features first and then one DeepStack level each (the
language model adds level k to the image tokens' hidden states after its decoder layer k).

`make_vision_encoder` picks it for `qwen3_vl` checkpoints: the encoder service caches each image's
tensor as one entry (EmbeddingRef.shape = [parts, rows, hidden]) and the decoder's in-process source
returns it as is.
"""

from __future__ import annotations

import torch

from common.checkpoint import CheckpointError
from common.families.qwen2_5_vl.encoder_base import QwenFamilyEncoder
from common.families.qwen3_vl.tower import Qwen3VisionFeatures, Qwen3VisionOps, load_qwen3_tower

QWEN3_MODEL_TYPES = ("qwen3_vl",)


def is_qwen3_vl(config: dict) -> bool:
    """True for a (dense) Qwen3-VL checkpoint's config.json."""
    return config.get("model_type") in QWEN3_MODEL_TYPES


class Qwen3VisionEncoder(QwenFamilyEncoder):
    """Images to Qwen3-VL image embeddings, [parts, tokens, text hidden] per image (tokens from its grid,
    parts = 1 + DeepStack levels)."""

    eager_ops = Qwen3VisionOps
    # The checkpoints' model_types whose tower this is (a family sharing the tower names its own).
    model_types: tuple[str, ...] = QWEN3_MODEL_TYPES

    def _check_model(self, config: dict) -> None:
        if config.get("model_type") not in self.model_types:
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen3-VL checkpoint")

    def _load_tower(self, vision_config: dict) -> torch.nn.Module:
        return load_qwen3_tower(self.model_dir, vision_config, self.device, self.dtype)

    def _merger_width(self) -> int:
        return self.tower.merger.linear_fc2.out_features

    def _per_image(self, features: Qwen3VisionFeatures, sizes: list[int]) -> list[torch.Tensor]:
        return features.split(sizes)
