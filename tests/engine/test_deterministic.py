"""The deterministic mode (`--deterministic`, decoder_svc/model/batch_invariant.py): one request's tokens
AND logprobs are the same bits alone, among other requests, chunked, after a prefix hit and after a
preemption, and its greedy tokens still equal HF's.

Without the mode these runs differ in the logprobs' last bits on this CPU (MKL sums a row of few rows in
another order, SDPA a row of a chunk in another grouping), so the exact comparisons below fail if either
half of the mode is off. Each family's test_deterministic.py repeats the core of it; the GPU half (the
Triton kernels compiled) is tests/gpu/test_deterministic_gpu.py.
"""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig, SamplingParams
from decoder_svc.model.backends import make_kernels
from decoder_svc.model.batch_invariant import TiledTorchAttentionBackend
from tests.deterministic_runs import N, pictures, reference_run

PROMPTS = ("USER: <image>\nWhat is shown in this picture? Describe it in detail. ASSISTANT:",
           "USER: <image>\nwhat color? ASSISTANT:", "USER: tell me a story about a long road. ASSISTANT:")


@pytest.fixture(scope="module")
def images():
    return pictures()


def test_llava_same_bits_in_any_company_chunk_and_cache_state(make_engine, hf_oracle, images):
    def run(company: int = 0, warm: bool = False, **overrides):
        return reference_run(make_engine(deterministic=True, **overrides), images, PROMPTS, company, warm)

    alone = run()
    assert len(alone[1]) == N
    runs = {
        "7 others": run(7),
        "31 others": run(31, max_num_seqs=32),
        "chunks of 7": run(max_num_batched_tokens=7),
        "chunks of 13 with 3 others": run(3, max_num_batched_tokens=13),
        "prefix hit": run(warm=True, max_num_batched_tokens=13),
        "preempted": run(3, num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4),
    }
    for name, result in runs.items():
        assert result == alone, name
    # the greedy tokens are still HF's (the mode changes the sums' order, not the model)
    hf_oracle.assert_same_tokens(alone[0], PROMPTS[0], images[:1], N)


def test_a_seeded_sample_is_the_same_in_company(make_engine, images):
    seeded = SamplingParams(max_tokens=N, logprobs=2, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = reference_run(make_engine(deterministic=True), images, PROMPTS, params=seeded)
    among = reference_run(make_engine(deterministic=True, max_num_batched_tokens=11), images, PROMPTS,
                          company=5, params=seeded)
    assert among == alone


def test_the_mode_picks_the_invariant_kernels_and_refuses_what_it_does_not_cover(tiny_model_dir):
    backend, _ = make_kernels("auto", "cpu", deterministic=True)
    assert isinstance(backend, TiledTorchAttentionBackend)
    backend, _ = make_kernels("auto", "cpu")
    assert not isinstance(backend, TiledTorchAttentionBackend)
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model=tiny_model_dir, deterministic=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization fp8"):
        EngineConfig(model=tiny_model_dir, deterministic=True, quantization="fp8")


def test_the_flag_reaches_the_model(make_engine):
    assert make_engine(deterministic=True).model.batch_invariant
    assert not make_engine().model.batch_invariant
