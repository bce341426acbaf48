"""Qwen3.5's image layout: Qwen3-VL's (HF's Qwen3.5 checkpoints use Qwen3VLProcessor, the Qwen2-VL image
processor and Qwen3-VL's video processor; Qwen3_5Model.get_rope_index is Qwen3-VL's, video grids split
per frame), so only the checkpoint check differs."""

from __future__ import annotations

from common.families.qwen3_vl.layout import Qwen3BasedImageLayout


class Qwen3_5ImageLayout(Qwen3BasedImageLayout):
    """The image side of a Qwen3.5 checkpoint (grids, token counts, M-RoPE positions: Qwen3-VL's)."""

    model_types = ("qwen3_5",)
    checkpoint_name = "Qwen3.5"


QWEN3_5_MODEL_TYPES = Qwen3_5ImageLayout.model_types
