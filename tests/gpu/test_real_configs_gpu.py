"""The LLaVA-family presets on CUDA with the Triton kernels and decode CUDA graphs: token parity with HF in
fp32. Covers what the tiny preset does not: Qwen2's q/k/v biases (added by the fused projection) and tied
embeddings, Mistral's 4:1 GQA and sliding-window cap, SigLIP's 729 and CLIP-336's 576 image tokens."""

from __future__ import annotations

import pytest
import torch

from common.families.llava.oracle import LlavaOracle
from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.conftest import _made
from tests.integration.test_real_configs import CASES
from tests.oracle import make_image, run_all

pytestmark = pytest.mark.gpu

N = 24


@pytest.mark.parametrize("budget", [256, 4096])  # chunked prefill (images straddle chunks) and whole
@pytest.mark.parametrize("preset", list(CASES))
def test_cuda_fp32_triton_parity(tmp_path_factory, preset, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    case = CASES[preset]
    model_dir = _made(tmp_path_factory, preset, seed=0)
    oracle = LlavaOracle(model_dir, device="cuda", dtype=torch.float32)
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          max_num_batched_tokens=budget, attention_backend="triton")
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    assert engine.runner.uses_cuda_graphs
    images = [make_image(31, (40, 52)), make_image(32, (300, 180))]
    jobs = {"text": (case.text, []), "one": (case.one_image, images[:1]), "two": (case.two_images, images)}
    for rid, (prompt, imgs) in jobs.items():
        engine.add_request(rid, prompt, imgs, sampling=SamplingParams(max_tokens=N))
    results = run_all(engine)
    for rid, (prompt, imgs) in jobs.items():
        assert results[rid]["error"] is None, results[rid]["error"]
        oracle.assert_same_tokens(results[rid]["tokens"], prompt, imgs, N)
    assert engine.runner.graph_steps > 0
