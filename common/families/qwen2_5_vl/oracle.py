"""The Qwen2.5-VL oracle: Hugging Face's Qwen2_5_VLForConditionalGeneration on the same checkpoint.

HF's Qwen processor class needs torchvision (for video); its inputs are built here as it builds them,
from the checkpoint's Qwen2-VL image processor (PIL backend) and tokenizer: each <|image_pad|> expanded
to the image's grid t*h*w/4 tokens (2x2 merge), and mm_token_type_ids marking image tokens (get_rope_index
reads it). Qwen3-VL's oracle builds its inputs with the same functions (qwen_pixels, qwen_inputs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import greedy_new_tokens, image_identity
from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor

IMAGE_PAD = "<|image_pad|>"


def qwen_pixels(image_processor, images: list[Image.Image], pixels: list[tuple[int, int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [patches, patch_dim] and image_grid_thw [images, 3], one image at a time (each in its
    own (min, max) pixel range where `pixels` names one, else the processor's)."""
    values, grids = [], []
    for i, image in enumerate(images):
        kw = {}
        if pixels and pixels[i]:
            kw["size"] = {"shortest_edge": pixels[i][0], "longest_edge": pixels[i][1]}
        one = image_processor(images=[image], return_tensors="pt", **kw)
        values.append(one["pixel_values"])
        grids.append(one["image_grid_thw"])
    return torch.cat(values), torch.cat(grids)


def qwen_inputs(model, tokenizer, image_processor, prompt: str, images: list[Image.Image],
                pixels: list[tuple[int, int]] | None = None) -> dict:
    """Model inputs for a raw prompt whose <|image_pad|> markers stand for images, in order, as HF's Qwen
    processors build them: each marker expanded to its image's t*h*w / merge^2 tokens, and
    mm_token_type_ids marking the image tokens (get_rope_index reads it). Qwen2.5-VL's and Qwen3-VL's."""
    out: dict = {}
    counts: list[int] = []
    if images:
        out["pixel_values"], out["image_grid_thw"] = qwen_pixels(image_processor, images, pixels)
        merge = int(model.config.vision_config.spatial_merge_size)
        counts = [int(g.prod()) // merge**2 for g in out["image_grid_thw"]]
    pieces = prompt.split(IMAGE_PAD)
    assert len(pieces) - 1 == len(images)
    text = pieces[0] + "".join(IMAGE_PAD * n + p for n, p in zip(counts, pieces[1:], strict=True))
    enc = tokenizer(text, return_tensors="pt")
    out["input_ids"], out["attention_mask"] = enc["input_ids"], enc["attention_mask"]
    out["mm_token_type_ids"] = (enc["input_ids"] == model.config.image_token_id).int()
    return out


class QwenOracle:
    """greedy `generate` and `get_image_features` of HF's model (fp32, CPU)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = load_qwen_image_processor(model_dir)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._memo: dict = {}

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template's rendering with the generation prompt."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def inputs(self, prompt: str, images: list[Image.Image], pixels: list[tuple[int, int]] | None = None):
        """Model inputs for a raw prompt whose <|image_pad|> markers stand for images, in order."""
        return qwen_inputs(self.model, self.tokenizer, self.image_processor, prompt, images, pixels)

    def generate(self, prompt: str, images: list[Image.Image], n: int, pixels=None) -> list[int]:
        """HF's greedy tokens (memoised per prompt, image contents and settings)."""
        key = (prompt, tuple(map(image_identity, images)), n, str(pixels))
        if key not in self._memo:
            self._memo[key] = greedy_new_tokens(self.model, self.inputs(prompt, images, pixels), n)
        return self._memo[key]

    def image_features(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """get_image_features rows per image."""
        inputs = self.inputs(IMAGE_PAD * len(images), images)
        with torch.no_grad():
            out = self.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                image_grid_thw=inputs["image_grid_thw"])
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return list(feats)
