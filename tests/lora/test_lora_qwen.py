"""A text LoRA on another family (Qwen2.5-VL: q/k/v biases, M-RoPE positions, tied head layout of its
own): served per request, its greedy tokens equal HF's Qwen2.5-VL on the checkpoint with the adapter
merged into its weights (fp32), in one batch with the base model; an image request too."""

from __future__ import annotations

import pytest

from common.families.qwen2_5_vl.oracle import QwenOracle
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.lora.adapters import merged_checkpoint, write_adapter
from tests.oracle import greedy, run_all

N = 10
TEXT = "<|im_start|>user\nWrite about a small red boat.<|im_end|>\n<|im_start|>assistant\n"
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
       "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen_lora(qwen_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-lora")
    adapter = write_adapter(qwen_model_dir, root / "q1", seed=5, rank=6, alpha=12.0)
    merged = QwenOracle(merged_checkpoint(qwen_model_dir, adapter, root / "merged"))
    return adapter, merged


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_qwen_adapter_equals_merged_weights(qwen_model_dir, qwen_oracle, qwen_lora, qwen_images,
                                            async_scheduling):
    adapter, merged = qwen_lora
    config = EngineConfig(model=qwen_model_dir, num_kv_blocks=512, max_num_batched_tokens=24,
                          async_scheduling=async_scheduling, lora_modules={"q1": str(adapter)})
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    engine.add_request("base", TEXT, sampling=greedy(N))
    engine.add_request("lora", TEXT, sampling=greedy(N), lora_adapter="q1")
    results = run_all(engine)
    assert results["base"]["tokens"] == qwen_oracle.generate(TEXT, [], N)
    assert results["lora"]["tokens"] == merged.generate(TEXT, [], N)
    assert results["lora"]["tokens"] != results["base"]["tokens"]
    out = engine.generate("img", ONE, [qwen_images[0]], sampling=greedy(N), lora_adapter="q1")
    assert out.new_token_ids == merged.generate(ONE, [qwen_images[0]], N)
