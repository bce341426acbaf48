"""LLaVA's oracle: Hugging Face's LlavaForConditionalGeneration on the same checkpoint (its processor
expands each <image> itself)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import image_identity


class LlavaOracle:
    """LlavaForConditionalGeneration.generate on the same checkpoint: the reference for our tokens."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self._memo: dict = {}

    def generate(self, prompt: str, images: list[Image.Image], max_new_tokens: int):
        """(token ids, per-step raw logits [n, vocab]) of greedy decoding."""
        key = (prompt, tuple(map(image_identity, images)), max_new_tokens)
        if key not in self._memo:
            inputs = self.processor(text=prompt, images=images or None, return_tensors="pt").to(self.device)
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
            with torch.no_grad():
                out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                          output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
            self._memo[key] = (tokens, torch.cat(out.logits).float().cpu())
        return self._memo[key]

    def assert_same_tokens(self, ours: list[int], prompt: str, images: list[Image.Image], n: int) -> None:
        """Equality with HF greedy; on a mismatch the message reports HF's top-2 margin there."""
        ref, logits = self.generate(prompt, images, n)
        if ours == ref:
            return
        diffs = [k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b]
        i = diffs[0] if diffs else min(len(ours), len(ref))
        margin = None
        if i < logits.shape[0]:
            top2 = torch.topk(logits[i], 2).values
            margin = float(top2[0] - top2[1])
        raise AssertionError(f"tokens differ from HF at step {i} (HF top-2 logit margin there: {margin}):\n"
                             f"ours {ours}\nHF   {ref}")
