"""The Phi-4-multimodal oracle: Hugging Face's Phi4MultimodalForCausalLM on the same checkpoint (fp32, CPU).

Pixel inputs are pixels.py's (HF's image processor needs torchvision; bench/phi4mm_pixels_check.py checks
that the two agree where it is installed), prompts are expanded by Phi4MultimodalProcessor's rule (each
image token repeated num_img_tokens times).

The vision model runs with eager attention: under SDPA, HF's Phi4MultimodalVisionAttention (is_causal =
True) turns causal whenever its batch has no padded crop (its mask is then None and sdpa_attention_forward
falls back to the module's is_causal), so an image's features would depend on the other images of its
batch. Eager attention is bidirectional always, as the original model's SigLIP is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import greedy_new_tokens
from common.families.phi4mm.layout import Phi4ImageLayout
from common.families.phi4mm.pixels import batch_pixels, hd_transform


class Phi4Oracle:
    """HF's image embedding (what the model writes at the image tokens) and greedy `generate`."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Phi4MultimodalForCausalLM

        from common.checkpoint import load_config

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.layout = Phi4ImageLayout.from_checkpoint(model_dir, load_config(model_dir))
        self.model = Phi4MultimodalForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.model.embed_tokens_extend.image_embed.img_processor.config._attn_implementation = "eager"
        self.image_token_id = self.model.config.vision_config.image_token_id

    def pixels(self, images: list[Image.Image]) -> dict:
        """The processor's image outputs for images (image_pixel_values, image_sizes, image_attention_mask,
        num_img_tokens)."""
        return batch_pixels([hd_transform(im, self.layout.settings) for im in images])

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        """Model inputs for a prompt whose image tokens stand for images, in order."""
        out: dict = {}
        counts: list[int] = []
        if images:
            px = self.pixels(images)
            counts = px.pop("num_img_tokens")
            out.update(px)
        enc = self.tokenizer(self.layout.expand_prompt(prompt, counts), return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], **out}

    def image_features(self, images: list[Image.Image] | dict) -> list[torch.Tensor]:
        """HF's Phi4MultimodalImageEmbedding over images (or the processor outputs of them, batched): the
        rows it writes at each image's tokens, [num_img_tokens, hidden] per image."""
        px = dict(images) if isinstance(images, dict) else self.pixels(images)
        counts = list(px.pop("num_img_tokens"))
        ids = torch.full((1, sum(counts)), self.image_token_id)
        embed = self.model.model.embed_tokens_extend.image_embed
        with torch.no_grad():
            rows = embed(ids, torch.zeros(1, sum(counts), self.model.config.hidden_size),
                         image_pixel_values=px["image_pixel_values"], image_sizes=px["image_sizes"],
                         image_attention_mask=px["image_attention_mask"])[0]
        return list(rows.split(counts))

    def generate(self, prompt: str, images: list[Image.Image], n: int) -> list[int]:
        """HF's greedy new tokens."""
        return greedy_new_tokens(self.model, self.inputs(prompt, images), n)
