"""The correctness oracle shared by engine, integration and GPU tests: Hugging Face transformers itself."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from decoder_svc.engine import LLMEngine, SamplingParams


def image_identity(image: Image.Image) -> tuple:
    """A memo key for an image by its content: never id(), which a later image may reuse once this one
    is freed (an oracle keyed by id() once answered for the wrong image)."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest()


def make_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    """A random RGB image (height, width) from a seeded numpy generator."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


class HFOracle:
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


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; per request id: dict(tokens, text, logprobs, finish, usage, error, deltas)."""
    results: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            r = results.setdefault(out.request_id, dict(tokens=[], text="", logprobs=[], deltas=[]))
            r["tokens"] += out.new_token_ids
            r["text"] += out.text
            r["deltas"].append(out.text)
            r["logprobs"] += out.logprobs
            if out.finished:
                r.update(finish=out.finish_reason, usage=out.usage, error=out.error)
    raise AssertionError("engine did not finish")


def greedy(n: int, **kw) -> SamplingParams:
    """Greedy sampling for n tokens."""
    return SamplingParams(max_tokens=n, **kw)
