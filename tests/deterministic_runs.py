"""What the deterministic-mode tests share: a reference request run alone, in company, chunked or after a
prefix hit, returning its tokens and logprobs to compare bit for bit (tests/engine/test_deterministic.py
and each family's test_deterministic.py)."""

from __future__ import annotations

from pathlib import Path

from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import make_image, run_all

N = 20
# Qwen2.5-VL's and Qwen3-VL's reference prompt, an image question and a text question.
QWEN_PROMPTS = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture? tell me more"
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>color?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\ntell a story<|im_end|>\n<|im_start|>assistant\n")


def pictures() -> list:
    """Eight seeded images of different sizes; the reference request asks about the first."""
    return [make_image(s, (40 + 3 * s, 52)) for s in range(1, 9)]


def default_params() -> SamplingParams:
    return SamplingParams(max_tokens=N, logprobs=3, ignore_eos=True)


def reference_run(engine: LLMEngine, images: list, prompts: tuple[str, str, str], company: int = 0,
                  warm: bool = False, params: SamplingParams | None = None,
                  media: dict | None = None) -> tuple[list, list]:
    """The reference request's (tokens, [(logprob, top ids, top logprobs)]), behind `company` other
    requests (images and text, different lengths) and, with `warm`, after the same request filled the
    prefix cache. prompts: (the reference, an image question, a text question). `media`: the reference's
    own media fields (default: the first image; e.g. {"videos": [...]}, or {} for a text reference)."""
    ref, image_ask, text_ask = prompts
    params = params or default_params()
    media = {"images": images[:1]} if media is None else media
    if warm:
        engine.add_request("warm", ref, sampling=params, **media)
        run_all(engine)
    for i in range(company):
        with_image = i % 2 == 0
        engine.add_request(f"other{i}", image_ask if with_image else text_ask,
                           [images[1 + i % 7]] if with_image else [],
                           sampling=SamplingParams(max_tokens=6 + i))
    engine.add_request("ref", ref, sampling=params, **media)
    out = run_all(engine)["ref"]
    assert engine.stats().kv_blocks_used == 0
    return out["tokens"], [(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in out["logprobs"]]


def deterministic_engine(model: Path, **overrides) -> LLMEngine:
    """An engine in the deterministic mode over the local tower (fp32 on CPU)."""
    config = EngineConfig(model=model, num_kv_blocks=256, deterministic=True, **overrides)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def assert_same_bits_in_company_and_after_a_prefix_hit(model: Path, prompts: tuple[str, str, str]) -> None:
    """The reference alone == among 7 others == after a prefix hit with chunks of 13, bit for bit."""
    images = pictures()
    alone = reference_run(deterministic_engine(model), images, prompts)
    assert len(alone[1]) == N
    assert reference_run(deterministic_engine(model), images, prompts, company=7) == alone
    assert reference_run(deterministic_engine(model, max_num_batched_tokens=13), images, prompts,
                         warm=True) == alone
