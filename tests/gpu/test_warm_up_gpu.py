"""The decoder's full warm-up (engine/warm_up.py) on a CUDA device: after it, the requests a service's
first users send (a cold prompt of a new length, eager, off a multiple of 16; a follow-up on its prefix;
two prompts in one step; decodes) compile no Triton kernel (Triton's jit_post_compile_hook counts every
kernel specialisation compiled in the process, fla's autotuning included). The first cold Qwen3.5 request
after start took 9.9 s on an H100 before it (2026-12-07d call 4)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.warm_up import warm_up


@contextlib.contextmanager
def compiled_kernels() -> Iterator[list[str]]:
    """The Triton kernels compiled in this process while the block runs (their names and signatures)."""
    from triton import knobs

    seen: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs) -> None:
        seen.append(kwargs["repr"])

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def _user_requests(engine: LLMEngine) -> None:
    ids = engine.tokenizer.tokenizer.encode("a cat sat on a mat and looked at the moon " * 200,
                                            add_special_tokens=False)
    ids = [i for i in ids if i < engine.model_config.vocab_size]
    cold = (ids * 4)[:1377]
    sampling = SamplingParams(max_tokens=4)
    assert not engine.generate("cold", prompt_token_ids=cold, sampling=sampling).error
    assert not engine.generate("follow-up", prompt_token_ids=cold[:1360] + ids[:45], sampling=sampling).error
    engine.add_request("a", prompt_token_ids=ids[7:1007], sampling=sampling)
    engine.add_request("b", prompt_token_ids=ids[3:254], sampling=sampling)
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("model", ["qwen3_5_model_dir", "qwen3_model_dir"])
def test_after_the_full_warm_up_users_requests_compile_nothing(model, request):
    model_dir: Path = request.getfixturevalue(model)
    config = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=1024)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    assert engine.config.full_warm_up
    warm_up(engine, full=True)
    with compiled_kernels() as compiled:
        _user_requests(engine)
    assert compiled == [], f"{len(compiled)} kernels compiled after the warm-up: {compiled[:5]}"
