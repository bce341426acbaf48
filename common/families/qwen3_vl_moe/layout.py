"""Qwen3-VL-MoE's image layout: Qwen3-VL's (the same processor, get_rope_index and video processor), so
only the checkpoint check differs."""

from __future__ import annotations

from common.families.qwen3_vl.layout import Qwen3BasedImageLayout


class Qwen3MoeImageLayout(Qwen3BasedImageLayout):
    """The image side of a Qwen3-VL-MoE checkpoint (grids, token counts, M-RoPE positions: Qwen3-VL's)."""

    model_types = ("qwen3_vl_moe",)
    checkpoint_name = "Qwen3-VL-MoE"


QWEN3_MOE_MODEL_TYPES = Qwen3MoeImageLayout.model_types
