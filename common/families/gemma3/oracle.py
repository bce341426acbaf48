"""The Gemma 3 oracle: Hugging Face's Gemma3ForConditionalGeneration on the same checkpoint (fp32, CPU).

Inputs are built from the checkpoint's tokenizer and its PIL image processor (Gemma3ImageProcessorPil),
the prompt's `<start_of_image>` markers expanded by Gemma3Processor's own rule (its full_image_sequence),
and token_type_ids marking the soft tokens (HF's bidirectional image mask reads them). A checkpoint whose
image processor config turns pan-and-scan on goes through Gemma3Processor itself, its crop settings
passed on the call: the processor's own defaults (do_pan_and_scan False, min crop 256 px) would otherwise
win over the checkpoint's config (transformers 5's kwargs merge), while the image processor alone (and
this server) follows the config.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.checkpoint import load_config
from common.families.gemma3.encoder import load_gemma3_image_processor
from common.families.gemma3.layout import Gemma3ImageLayout
from common.families.oracle import greedy_new_tokens, image_identity


class Gemma3Oracle:
    """get_image_features and greedy `generate` of HF's model."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoProcessor, Gemma3ForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = load_gemma3_image_processor(model_dir)
        self.model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        pas = Gemma3ImageLayout.from_checkpoint(model_dir, load_config(model_dir)).pan_and_scan
        self.crop_kwargs = pas.processor_kwargs() if pas is not None else {}
        self._memo: dict = {}

    def pixels(self, images: list[Image.Image]) -> torch.Tensor:
        """pixel_values [tower images, 3, S, S] from the PIL image processor (with pan-and-scan, each
        image's original then its crops)."""
        return self.image_processor(images=images, return_tensors="pt", **self.crop_kwargs)["pixel_values"]

    def num_crops(self, images: list[Image.Image]) -> list[int]:
        """The crops HF's image processor cuts each image into (0 each without pan-and-scan)."""
        return [int(n) for n in self.image_processor(images=images, **self.crop_kwargs)["num_crops"]]

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        """Model inputs for a prompt whose `<start_of_image>` markers stand for images, in order."""
        if prompt.count(self.processor.boi_token) != len(images):
            raise ValueError("one <start_of_image> per image")
        if self.crop_kwargs:  # HF's processor writes the crops' sentence and blocks
            enc = self.processor(text=prompt, images=images or None, return_tensors="pt", **self.crop_kwargs)
            out = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in enc}
            out["token_type_ids"] = (enc["input_ids"] == self.model.config.image_token_index).long()
            return out
        text = prompt.replace(self.processor.boi_token, self.processor.full_image_sequence)
        enc = self.tokenizer(text, return_tensors="pt")
        out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "token_type_ids": (enc["input_ids"] == self.model.config.image_token_index).long()}
        if images:
            out["pixel_values"] = self.pixels(images)
        return out

    def chat_inputs(self, messages: list[dict], images: list[Image.Image]) -> dict:
        """Model inputs for a chat: the checkpoint's template rendered, then HF's processor on that text
        (the template writes the BOS: none is added), soft tokens marked for the image block mask."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = self.processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt",
                             **self.crop_kwargs)
        out = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in enc}
        out["token_type_ids"] = (enc["input_ids"] == self.model.config.image_token_index).long()
        return out

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """get_image_features: [tower images, mm_tokens_per_image, text hidden]."""
        with torch.no_grad():
            out = self.model.get_image_features(pixel_values=pixel_values)
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def generate(self, prompt: str, images: list[Image.Image], n: int) -> list[int]:
        """HF's greedy new tokens (memoised per prompt, image contents, crop settings and n: tests ask the
        same again)."""
        key = (prompt, tuple(map(image_identity, images)), n, str(self.crop_kwargs))
        if key not in self._memo:
            self._memo[key] = greedy_new_tokens(self.model, self.inputs(prompt, images), n)
        return list(self._memo[key])
