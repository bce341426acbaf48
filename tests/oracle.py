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


def waves_equal_hf(engine: LLMEngine, oracle, waves: list[dict], n: int, logprob_atol: float = 1e-4) -> dict:
    """Run each wave of requests ({id: (prompt, images)}) to the end, one wave after another, greedy for n
    tokens with logprobs; assert every request's tokens equal `oracle.generate`'s and its first token's
    logprob the oracle model's to logprob_atol (a state resumed wrongly can still give the same tokens).
    Returns run_all's results of every wave."""
    import torch

    results: dict = {}
    for wave in waves:
        for rid, (prompt, imgs) in wave.items():
            engine.add_request(rid, prompt, imgs, sampling=greedy(n, logprobs=1))
        results.update(run_all(engine))
    for rid, (prompt, imgs) in {k: v for wave in waves for k, v in wave.items()}.items():
        assert results[rid]["tokens"] == oracle.generate(prompt, imgs, n), rid
        with torch.no_grad():
            logits = oracle.model(**oracle.inputs(prompt, imgs)).logits[0, -1].float()
        first = results[rid]["logprobs"][0]
        ref = float(torch.log_softmax(logits, -1)[results[rid]["tokens"][0]])
        assert abs(first.logprob - ref) < logprob_atol, (rid, first, ref)
    return results
