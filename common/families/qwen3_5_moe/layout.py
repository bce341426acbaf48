"""Qwen3.5-MoE's image layout: Qwen3.5's, which is Qwen3-VL's (the same processors and M-RoPE rule), so
only the checkpoint check differs."""

from __future__ import annotations

from common.families.qwen3_vl.layout import Qwen3BasedImageLayout


class Qwen3_5MoeImageLayout(Qwen3BasedImageLayout):
    """The image side of a Qwen3.5-MoE checkpoint (grids, token counts, M-RoPE positions: Qwen3-VL's)."""

    model_types = ("qwen3_5_moe",)
    checkpoint_name = "Qwen3.5-MoE"
