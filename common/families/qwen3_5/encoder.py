"""The vision half of a Qwen3.5 checkpoint: Qwen3-VL's tower without DeepStack levels (HF's
Qwen3_5VisionModel is Qwen3VLVisionModel with `deepstack_merger_list` removed: the same patch embedding,
interpolated position table, 2D rotary blocks and final merger), so our Qwen3VisionTower with no
DeepStack index computes it. Each image gives one [tokens, hidden] tensor, as Qwen2.5-VL's do."""

from __future__ import annotations

import torch

from common.checkpoint import CheckpointError
from common.families.qwen3_5.layout import QWEN3_5_MODEL_TYPES
from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
from common.families.qwen3_vl.tower import Qwen3VisionFeatures, load_qwen3_tower


class Qwen3_5VisionEncoder(Qwen3VisionEncoder):
    """Images to Qwen3.5 image embeddings, [tokens, text hidden] per image (tokens from its grid)."""

    def _check_model(self, config: dict) -> None:
        if config.get("model_type") not in QWEN3_5_MODEL_TYPES:
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen3.5 checkpoint")

    def _load_tower(self, vision_config: dict) -> torch.nn.Module:
        if vision_config.get("deepstack_visual_indexes"):
            raise CheckpointError("a Qwen3.5 vision config names no deepstack_visual_indexes")
        return load_qwen3_tower(self.model_dir, {**vision_config, "deepstack_visual_indexes": []},
                                self.device, self.dtype)

    def _per_image(self, features: Qwen3VisionFeatures, sizes: list[int]) -> list[torch.Tensor]:
        return list(features.merged.split(sizes))
