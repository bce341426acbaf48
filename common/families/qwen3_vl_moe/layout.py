"""Qwen3-VL-MoE's image layout: Qwen3-VL's (the same processor, get_rope_index and video processor), so
only the checkpoint check differs."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from common.checkpoint import CheckpointError
from common.families.qwen2_5_vl.layout import QwenImageLayout, read_qwen_layout

QWEN3_MOE_MODEL_TYPES = ("qwen3_vl_moe",)


class Qwen3MoeImageLayout(QwenImageLayout):
    """The image side of a Qwen3-VL-MoE checkpoint (grids, token counts, M-RoPE positions: Qwen3-VL's)."""

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> QwenImageLayout:
        """read_qwen_layout's layout of a qwen3_vl_moe checkpoint; CheckpointError for any other."""
        if config.get("model_type") not in QWEN3_MOE_MODEL_TYPES:
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a Qwen3-VL-MoE checkpoint")
        base = read_qwen_layout(model_dir, config)
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)})
