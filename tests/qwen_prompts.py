"""What the Qwen families' parity tests share (tests/qwen, qwen3, qwen3_5, qwen3_vl_moe): ChatML prompts
whose vision blocks stand for images in order, and the check that an engine's greedy tokens are HF's."""

from __future__ import annotations

from typing import Any

from tests.oracle import greedy

USER = "<|im_start|>user\n"
END = "<|im_end|>\n<|im_start|>assistant\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = USER + VISION + "what is in the picture?" + END
TWO = USER + "first " + VISION + " then " + VISION + " compare them" + END
THREE = USER + "first " + VISION + " then " + VISION + VISION + " compare them" + END
TEXT = USER + "describe a red car on the table" + END


def tokens_equal_hf(engine: Any, oracle: Any, prompt: str, imgs: list, rid: str = "r", *, n: int,
                    **kw: Any) -> Any:
    """engine.generate's greedy output for `n` tokens, checked served without error and equal to the
    oracle's generate."""
    out = engine.generate(rid, prompt, imgs, sampling=greedy(n), **kw)
    assert out.error is None, out.error
    assert out.new_token_ids == oracle.generate(prompt, imgs, n), "tokens differ from HF"
    return out
