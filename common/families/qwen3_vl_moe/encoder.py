"""The vision half of a Qwen3-VL-MoE checkpoint: Qwen3-VL's (HF's Qwen3VLMoeVisionModel is Qwen3VLVisionModel
under another name: the same tower, DeepStack mergers and parameter names), so Qwen3-VL's encoder with
this family's model_type."""

from __future__ import annotations

from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
from common.families.qwen3_vl_moe.layout import QWEN3_MOE_MODEL_TYPES


class Qwen3MoeVisionEncoder(Qwen3VisionEncoder):
    """Images to Qwen3-VL-MoE image embeddings, [parts, tokens, text hidden] per image (Qwen3-VL's)."""

    model_types = QWEN3_MOE_MODEL_TYPES
