"""The image layout of the families built on Qwen3-VL (Qwen3-VL-MoE, Qwen3.5): Qwen3-VL's, i.e. Qwen2.5-VL's
grid geometry (common/families/qwen2_5_vl/layout.py; the same processor, get_rope_index and video
processor), under a checkpoint check of the family's own model types. Qwen3-VL itself serves
QwenImageLayout, whose check takes both Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar

from common.checkpoint import CheckpointError
from common.families.qwen2_5_vl.layout import QwenImageLayout, read_qwen_layout


class Qwen3BasedImageLayout(QwenImageLayout):
    """QwenImageLayout for one family's checkpoints: a subclass names its `model_types` and the
    `checkpoint_name` a refusal says."""

    model_types: ClassVar[tuple[str, ...]]
    checkpoint_name: ClassVar[str]

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: dict[str, Any]) -> QwenImageLayout:
        """read_qwen_layout's layout of a checkpoint of cls.model_types; CheckpointError for any other."""
        if config.get("model_type") not in cls.model_types:
            raise CheckpointError(f"model_type {config.get('model_type')!r} is not a {cls.checkpoint_name} "
                                  "checkpoint")
        base = read_qwen_layout(model_dir, config)
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)})
