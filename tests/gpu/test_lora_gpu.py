"""Adapters on CUDA (the lent GPU only; never run in CI): the Triton LoRA kernels inside captured decode
graphs give HF's tokens on the merged weights in fp32, batches mixing adapters; the kernels match the
torch reference in bf16 at prefill sizes; FP8 base weights take the adapter inside graphs too."""

from __future__ import annotations

import pytest
import torch

from common.families.llava.oracle import LlavaOracle
from common.kernels.lora import GATHER_MAX_ROWS, lora_add_triton
from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.model.lora.reference import lora_add_reference
from tests.lora.adapters import merged_checkpoint, rounded_inner_product, write_adapter
from tests.oracle import run_all

pytestmark = pytest.mark.gpu

N = 16
TEXT = "USER: describe the red car on the table. ASSISTANT:"
LONG = "USER: " + "the quick brown fox jumps over the lazy dog " * 4 + "ASSISTANT:"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gpu")
    dirs = {"a1": write_adapter(tiny_model_dir, root / "a1", seed=1),
            "a2": write_adapter(tiny_model_dir, root / "a2", seed=2,
                                targets=("q_proj", "v_proj", "down_proj"), rank=8)}
    oracles = {"": LlavaOracle(tiny_model_dir, device="cuda", dtype=torch.float32)}
    for name, path in dirs.items():
        merged = merged_checkpoint(tiny_model_dir, path, root / f"m-{name}")
        oracles[name] = LlavaOracle(merged, device="cuda", dtype=torch.float32)
    return dirs, oracles


def _engine(model_dir, dirs, **kw) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", num_kv_blocks=256,
                          lora_modules={n: str(p) for n, p in dirs.items()}, **kw)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


@pytest.mark.parametrize("budget", [13, 4096])
def test_cuda_fp32_graphs_mix_adapters(tiny_model_dir, adapters, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    dirs, oracles = adapters
    engine = _engine(tiny_model_dir, dirs, dtype="float32", max_num_batched_tokens=budget)
    assert engine.runner.uses_cuda_graphs
    plan = {"b": ("", TEXT), "x": ("a1", TEXT), "y": ("a2", LONG), "z": ("a1", LONG), "w": ("a2", TEXT)}
    for rid, (adapter, prompt) in plan.items():
        engine.add_request(rid, prompt, sampling=SamplingParams(max_tokens=N), lora_adapter=adapter)
    results = run_all(engine)
    assert engine.runner.graph_steps > 0
    for rid, (adapter, prompt) in plan.items():
        oracles[adapter].assert_same_tokens(results[rid]["tokens"], prompt, [], N)


@pytest.mark.parametrize("rows", [1, 3, 7, 64, 2048])
@pytest.mark.parametrize(("rank", "k"), [(48, 2048), (256, 8192)])  # 256: Phi-4-multimodal's vision adapter
def test_cuda_kernels_match_reference_bf16(rows, rank, k):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    slots, n = 4, 3 * 1024
    a = torch.randn(slots * rank, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, slots * rank, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.1
    a[:rank], b[:, :rank] = 0, 0
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    y = torch.randn(rows, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.randint(0, slots, (rows,), device="cuda", generator=gen)
    want = lora_add_reference(y, x, a, b, ids, rank)
    if rows > GATHER_MAX_ROWS:  # the stacked GEMMs round the inner product as PEFT does
        want = rounded_inner_product(y, x, a, b, ids, rank)
    got = lora_add_triton(y.clone(), x, a, b, ids, rank)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2)


def test_cuda_fp8_base_with_adapters_in_graphs(tiny_model_dir, adapters):
    dirs, _ = adapters
    engine = _engine(tiny_model_dir, dirs, dtype="bfloat16", quantization="fp8")
    outs = {a: engine.generate(f"r{a}", TEXT, sampling=SamplingParams(max_tokens=N), lora_adapter=a)
            for a in ("", "a1", "a2")}
    assert engine.runner.graph_steps > 0
    assert all(o.new_token_ids for o in outs.values())
    assert outs["a1"].new_token_ids != outs[""].new_token_ids
