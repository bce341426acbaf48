"""The Qwen3-VL oracle: Hugging Face's Qwen3VLForConditionalGeneration on the same checkpoint.

As for Qwen2.5-VL (common/families/qwen2_5_vl/oracle.py), HF's processor class needs torchvision, so
inputs are built by that oracle's qwen_inputs from the checkpoint's Qwen2-VL image processor (PIL backend)
and tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import greedy_new_tokens, image_identity
from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor
from common.families.qwen2_5_vl.oracle import IMAGE_PAD, qwen_inputs, qwen_pixels

__all__ = ["IMAGE_PAD", "Qwen3Oracle"]


class Qwen3Oracle:
    """greedy `generate` and `get_image_features` (merged and DeepStack) of HF's model (fp32, CPU)."""

    # The transformers class run (a family sharing Qwen3-VL's inputs and outputs names its own).
    hf_class = "Qwen3VLForConditionalGeneration"

    def __init__(self, model_dir: Path) -> None:
        import transformers
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = load_qwen_image_processor(model_dir)
        model_class = getattr(transformers, self.hf_class)
        self.model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.merge = int(self.model.config.vision_config.spatial_merge_size)
        self._memo: dict = {}

    def pixels(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [patches, patch_dim] and image_grid_thw [images, 3], one image at a time."""
        return qwen_pixels(self.image_processor, images)

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template's rendering with the generation prompt."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        """Model inputs for a raw prompt whose <|image_pad|> markers stand for images, in order."""
        return qwen_inputs(self.model, self.tokenizer, self.image_processor, prompt, images)

    def generate(self, prompt: str, images: list[Image.Image], n: int) -> list[int]:
        """HF's greedy new tokens (memoised per prompt, image contents and n: tests repeat them)."""
        key = (prompt, tuple(map(image_identity, images)), n)
        if key not in self._memo:
            self._memo[key] = greedy_new_tokens(self.model, self.inputs(prompt, images), n)
        return list(self._memo[key])

    def image_features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """get_image_features of one batch as [parts, rows_i, hidden] per image: the merged features
        (pooler_output) first, then each DeepStack level. Older transformers return a tuple
        (merged per image, DeepStack levels) instead of an output object; both are read."""
        with torch.no_grad():
            out = self.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grids)
        if isinstance(out, tuple):
            merged, levels = out
        else:
            merged, levels = out.pooler_output, out.deepstack_features
        sizes = [int(g.prod()) // self.merge**2 for g in grids]

        def rows(x) -> torch.Tensor:  # one [rows, hidden] tensor (transformers 5.17) or one per image
            return x if isinstance(x, torch.Tensor) else torch.cat(list(x))

        merged = rows(merged).split(sizes)
        levels = [rows(level).split(sizes) for level in levels]
        return [torch.stack([merged[i], *(level[i] for level in levels)]) for i in range(len(sizes))]
