"""The Qwen3.5 oracle: Hugging Face's Qwen3_5ForConditionalGeneration on the same checkpoint (fp32, CPU).

Inputs are built as for Qwen3-VL (common/families/qwen3_vl/oracle.py: the checkpoint's Qwen2-VL image
processor and tokenizer, HF's processor class needing torchvision). On a CPU without the `fla` and
`causal-conv1d` kernels HF runs its torch fallbacks of the Gated DeltaNet layers: the reference our
layer (decoder_svc/model/gated_deltanet.py) is checked against.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import greedy_new_tokens
from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor
from common.families.qwen2_5_vl.oracle import IMAGE_PAD, qwen_inputs, qwen_pixels

__all__ = ["IMAGE_PAD", "Qwen3_5Oracle"]


class Qwen3_5Oracle:
    """greedy `generate` and `get_image_features` of HF's model (fp32, CPU)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = load_qwen_image_processor(model_dir)
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.merge = int(self.model.config.vision_config.spatial_merge_size)

    def pixels(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [patches, patch_dim] and image_grid_thw [images, 3], one image at a time."""
        return qwen_pixels(self.image_processor, images)

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        """Model inputs for a raw prompt whose <|image_pad|> markers stand for images, in order."""
        return qwen_inputs(self.model, self.tokenizer, self.image_processor, prompt, images)

    def generate(self, prompt: str, images: list[Image.Image], n: int) -> list[int]:
        """HF's greedy new tokens."""
        return greedy_new_tokens(self.model, self.inputs(prompt, images), n)

    def image_features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """get_image_features of one batch as [rows_i, hidden] per image (the merged features: Qwen3.5 has
        no DeepStack levels)."""
        with torch.no_grad():
            out = self.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grids)
        merged = out.pooler_output
        merged = merged if isinstance(merged, torch.Tensor) else torch.cat(list(merged))
        return list(merged.split([int(g.prod()) // self.merge**2 for g in grids]))
