"""What engine, integration and GPU tests share: test images and driving an engine to the end. The HF
oracles themselves are the families' (common/families/<name>/oracle.py)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from decoder_svc.engine import LLMEngine, SamplingParams


def make_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    """A random RGB image (height, width) from a seeded numpy generator."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


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
