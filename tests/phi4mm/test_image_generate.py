"""Phi-4-MM image requests through the encoder service and the in-process engine equal HF's
Phi4MultimodalForCausalLM (fp32, CPU) with the checkpoint's vision LoRA merged into its weights (the
oracle's `vision` model; HF's class has no LoRA modules): greedy tokens and the first step's top-5
logprobs, for one image and two, whole prefill and chunks that split the images, and a repeat (prefix KV
under the vision adapter and the encoder's cache reused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.images import encode_png
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.sampling_params import SamplingParams
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness
from tests.phi4mm.images import sample_images

N = 8
CASES = {  # prompt, indices into sample_images()
    "one": ("<|user|><|image|>write a long story about a red car that drives along the coast at night, past "
            "the lighthouse<|end|><|assistant|>", (1,)),
    "two": ("<|user|>look <|image|> and <|image|> then say<|end|><|assistant|>", (1, 0)),
}


@pytest.fixture(scope="module")
def encoder(phi4_tiny_dir: Path) -> Iterator[EncoderHarness]:
    harness = EncoderHarness(EncoderConfig(model=phi4_tiny_dir, cache_bytes=16 << 20, lease_ttl_s=30))
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def hf(phi4_oracle) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per case: HF's greedy tokens and its first step's log-probabilities."""
    out = {}
    for name, (prompt, idx) in CASES.items():
        images = [sample_images()[i] for i in idx]
        out[name] = (phi4_oracle.generate(prompt, images, N), phi4_oracle.first_logprobs(prompt, images))
    return out


def _engine(model: Path, encoder: EncoderHarness, budget: int) -> tuple[LLMEngine, RemoteEmbeddingSource]:
    source = RemoteEmbeddingSource([f"127.0.0.1:{encoder.port}"])
    config = EngineConfig(model=model, num_kv_blocks=256, max_num_batched_tokens=budget, block_size=16)
    return LLMEngine(config, source), source


@pytest.mark.parametrize("budget", [2048, 100])
def test_tokens_and_logprobs_equal_hf_and_a_repeat_reuses(phi4_tiny_dir, encoder, hf, budget):
    engine, source = _engine(phi4_tiny_dir, encoder, budget)
    try:
        for name, (prompt, idx) in CASES.items():
            files = [encode_png(sample_images()[i]) for i in idx]
            want, logprobs = hf[name]
            assert len(set(want)) >= 2 or name == "two", "the comparison should see varied tokens"
            for attempt in range(2):
                out = engine.generate(f"{name}{attempt}", prompt, files,
                                      sampling=SamplingParams(max_tokens=N, temperature=0, logprobs=5))
                assert out.error is None and out.new_token_ids == want, (name, attempt)
                first = out.logprobs[0]
                top = logprobs.topk(5)
                assert first.top_ids == top.indices.tolist()
                torch.testing.assert_close(torch.tensor(first.top_logprobs), top.values, rtol=0, atol=1e-4)
                assert out.usage.images == len(files)
                if attempt:  # the repeat: the prompt's KV blocks before the last one, and no tower work
                    assert out.usage.cached_prompt_tokens > 0
    finally:
        source.close()
    assert encoder.stats().active_leases == 0
