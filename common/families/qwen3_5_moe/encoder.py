"""The vision half of a Qwen3.5-MoE checkpoint: Qwen3.5's tower (Qwen3-VL's without DeepStack levels)."""

from __future__ import annotations

from common.checkpoint import CheckpointError
from common.families.qwen3_5.encoder import Qwen3_5VisionEncoder
from common.families.qwen3_5_moe.layout import Qwen3_5MoeImageLayout


class Qwen3_5MoeVisionEncoder(Qwen3_5VisionEncoder):
    """Images to Qwen3.5-MoE image embeddings, [tokens, text hidden] per image."""

    def _check_model(self, config: dict) -> None:
        if config.get("model_type") not in Qwen3_5MoeImageLayout.model_types:
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen3.5-MoE checkpoint")
