"""Tensor parallelism on two GPUs (NCCL): TP=2 gives TP=1's and HF's tokens in fp32 on the tiny preset.
Skipped with fewer than two CUDA devices (a one-GPU machine runs the CPU/gloo tests in tests/engine)."""

from __future__ import annotations

import pytest
import torch

from common.families.llava.oracle import LlavaOracle
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, make_image, run_all

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
N = 12


def _tokens(model_dir, tp: int) -> dict:
    cfg = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=128,
                       tensor_parallel_size=tp, max_num_batched_tokens=13)
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))
    try:
        for i in range(3):
            engine.add_request(f"r{i}", PROMPT, [make_image(20 + i)], sampling=greedy(N))
        return {rid: r["tokens"] for rid, r in run_all(engine).items()}
    finally:
        engine.close()


def test_two_gpus_equal_one_and_hf(tiny_model_dir):
    split, single = _tokens(tiny_model_dir, 2), _tokens(tiny_model_dir, 1)
    assert split == single
    oracle = LlavaOracle(tiny_model_dir, device="cuda", dtype=torch.float32)
    for i in range(3):
        oracle.assert_same_tokens(split[f"r{i}"], PROMPT, [make_image(20 + i)], N)
