"""n samples of one prompt on CUDA (decoder_svc/engine/fanout.py): the forked choices, whose last partial
KV block the runner copies on the device, give the tokens of n separate requests seeded seed+i, with the
Triton kernels and decode CUDA graphs, in fp32 (bf16 rounds differently in a batch of other rows, so its
agreement is printed, not asserted); nothing is held afterwards."""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.fanout import child_seed
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is shown in this picture, and which colours? ASSISTANT:"


def _engine(model_dir, dtype: str) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", dtype=dtype, num_kv_blocks=256)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def _run(engine: LLMEngine) -> dict:
    got: dict = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return got
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forked_choices_equal_separate_seeded_requests_on_cuda(tiny_model_dir, dtype):
    n, images = 4, [make_image(1)]
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    separate = _engine(tiny_model_dir, dtype)
    for i in range(n):
        params = SamplingParams(**{**sampling.__dict__, "seed": child_seed(sampling.seed, i)})
        separate.add_request(f"s{i}", PROMPT, images, sampling=params)
    want = _run(separate)
    engine = _engine(tiny_model_dir, dtype)
    engine.add_request("p", PROMPT, images, sampling=sampling, n=n)
    got = _run(engine)
    same = [got[("p", i)] == want[(f"s{i}", 0)] for i in range(n)]
    print(f"\n{dtype}: choices equal to their separate request: {same}")
    if dtype == "float32":
        assert all(same)
    assert len({tuple(t) for t in got.values()}) > 1
    stats = engine.stats()
    assert stats.samples_forked == n - 1 and stats.kv_blocks_used == 0 and stats.running == 0
