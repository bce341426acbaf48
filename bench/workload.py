"""Synthetic workloads: an image pool with a repeat ratio and random-word prompts of a target length."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

QWEN_USER, QWEN_END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "gu", "shi", "tor", "bel", "qua"]


def random_png(seed: int, size: int = 64) -> bytes:
    """A size x size PNG of uniform noise: every seed gives different pixels, so a different hash."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def random_words(rng: random.Random, n: int) -> str:
    """n random pseudo-words (distinct texts share no prefix beyond chance)."""
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


class PromptMaker:
    """Random-word text of about `tokens` tokens, calibrated with the model's tokenizer when given."""

    def __init__(self, model_dir: str | Path | None = None, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.tokens_per_word = 1.5  # a guess used when no tokenizer is available
        self._tok = None
        self.qwen = False  # the model takes Qwen-VL's prompt format
        if model_dir is not None:
            from transformers import AutoTokenizer

            from common.checkpoint import load_config

            self.qwen = lays_out_by_grid(load_config(model_dir))

            self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            sample = random_words(random.Random(seed + 1), 400)
            self.tokens_per_word = len(self._tok(sample, add_special_tokens=False).input_ids) / 400

    def shared_text(self, tokens: int) -> str:
        """The same text of about `tokens` tokens on every call (a fixed instruction)."""
        saved, self.rng = self.rng, random.Random(12345)
        try:
            return self.text(tokens)
        finally:
            self.rng = saved

    def image_prompt(self, text: str, num_images: int = 1, shared: str = "") -> str:
        """`image_prompt` in this model's format."""
        return image_prompt(text, num_images, shared, self.qwen)

    def text(self, tokens: int) -> str:
        """Fresh random text of roughly `tokens` tokens (exact count when a tokenizer is loaded)."""
        if tokens <= 0:
            return ""
        words = max(1, round(tokens / self.tokens_per_word))
        text = random_words(self.rng, words)
        if self._tok is None:
            return text
        ids = self._tok(text, add_special_tokens=False).input_ids
        while len(ids) < tokens:
            text += " " + random_words(self.rng, max(1, round((tokens - len(ids)) / self.tokens_per_word)))
            ids = self._tok(text, add_special_tokens=False).input_ids
        return self._tok.decode(ids[:tokens]) if len(ids) > tokens else text


def lays_out_by_grid(config: dict) -> bool:
    """True when the checkpoint's family lays images out as Qwen-VL does (its layout is a QwenImageLayout:
    Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), so its prompts take Qwen's ChatML and vision tokens."""
    from common.families.qwen2_5_vl.layout import QwenImageLayout
    from common.families.registry import layout_family

    return issubclass(layout_family(config).layout_class(), QwenImageLayout)


def image_prompt(text: str, num_images: int = 1, shared: str = "", qwen: bool = False) -> str:
    """The image markers, then the shared instruction, then the text: in LLaVA-1.5's format, or with
    qwen=True in Qwen-VL's ChatML with its vision tokens."""
    body = (shared + "\n" if shared else "") + text
    if qwen:
        return QWEN_USER + QWEN_IMAGE * num_images + body + QWEN_END
    return "USER: " + "<image>\n" * num_images + body + " ASSISTANT:"


@dataclass
class BenchRequest:
    """One request of a run: the prompt, its image (PNG bytes, or None) and whether it is a repeat."""

    prompt: str
    image: bytes | None
    image_id: int
    repeat: bool


def image_schedule(n: int, repeat_ratio: float, seed: int = 0) -> list[tuple[int, bool]]:
    """(image id, is_repeat) for n requests: round(n * repeat_ratio) of them reuse an earlier image.

    The first request is always fresh; a repeat picks uniformly among the images used before it.
    """
    rng = random.Random(seed)
    n_repeat = min(max(0, round(n * repeat_ratio)), max(0, n - 1))
    flags = [True] * n_repeat + [False] * (n - 1 - n_repeat)
    rng.shuffle(flags)
    out, used = [(0, False)], 1
    for is_repeat in flags:
        if is_repeat:
            out.append((rng.randrange(used), True))
        else:
            out.append((used, False))
            used += 1
    return out[:n]


def build_requests(n: int, repeat_ratio: float, prompt_len: int, prompts: PromptMaker,
                   image_size: int = 64, seed: int = 0, with_images: bool = True,
                   shared_len: int = 0) -> list[BenchRequest]:
    """n requests, one image each, then a shared instruction of shared_len tokens (the same for every
    request: with it a repeated image can be covered by whole cached KV blocks and skipped), then fresh
    text of prompt_len tokens. Repeats share the image bytes, not the text."""
    cache: dict[int, bytes] = {}
    shared = PromptMaker.shared_text(prompts, shared_len)
    out = []
    for image_id, repeat in image_schedule(n, repeat_ratio, seed):
        image = None
        if with_images:
            image = cache.get(image_id)
            if image is None:
                image = cache[image_id] = random_png(seed * 1_000_003 + image_id, image_size)
        text = prompts.text(prompt_len)
        out.append(BenchRequest(prompts.image_prompt(text, 1 if with_images else 0, shared), image, image_id,
                                repeat))
    return out
