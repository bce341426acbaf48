"""What a mixture-of-experts model refuses at start-up, in one clear line rather than a crash later: LoRA
adapters on its MoE layers (per-expert modules, the router, dense MLP names, PEFT's target_parameters) and
tensor parallelism; an adapter on the attention alone is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.checkpoint import CheckpointError
from decoder_svc.model.loader import load_language_model
from decoder_svc.model.lora import LoRAError
from decoder_svc.model.parallel import TensorParallel
from tests.lora.adapters import write_adapter

PREFIX = "base_model.model.model.language_model.layers.1."


def _adapter(out: Path, modules: dict[str, tuple[int, int]], **config) -> Path:
    """A rank-2 PEFT adapter with lora_A/B for `modules` (path under layer 1 -> (out, in))."""
    tensors = {}
    for module, (n, k) in modules.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(2, k) * 0.1
        tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(n, 2) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                         "target_modules": targets, **config}))
    return out


@pytest.fixture(scope="module")
def dims(qwen3_moe_model_dir):
    text = json.loads((qwen3_moe_model_dir / "config.json").read_text())["text_config"]
    return (text["hidden_size"], text["moe_intermediate_size"], text["intermediate_size"],
            text["num_local_experts"])


@pytest.mark.parametrize("modules", ["expert", "router", "dense_names"])
def test_lora_on_moe_layers_is_refused_naming_the_module(qwen3_moe_model_dir, dims, tmp_path, modules):
    hidden, width, dense, experts = dims
    targets = {"expert": {"mlp.experts.3.gate_proj": (width, hidden)},
               "router": {"mlp.gate": (experts, hidden)},
               # a dense model's MLP names on a MoE layer (an adapter for another model)
               "dense_names": {"mlp.down_proj": (hidden, dense)}}[modules]
    path = _adapter(tmp_path / "a", {"self_attn.q_proj": (hidden, hidden), **targets})
    # the router's name is no served target anywhere: the config's target_modules is refused first
    said = ("unknown target module.*'gate'.*LoRA on mixture-of-experts layers" if modules == "router" else
            "'moe'.* is in a mixture-of-experts MLP; LoRA on MoE layers")
    with pytest.raises(LoRAError, match=said):
        load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", lora_modules={"moe": path})


def test_lora_on_stacked_expert_parameters_is_refused(qwen3_moe_model_dir, dims, tmp_path):
    hidden = dims[0]
    path = _adapter(tmp_path / "a", {"self_attn.q_proj": (hidden, hidden)},
                    target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(LoRAError, match="mixture-of-experts .*target_parameters.* is not served"):
        load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", lora_modules={"moe": path})


def test_lora_on_the_attention_of_a_moe_model_is_served(qwen3_moe_model_dir, tmp_path):
    from decoder_svc.model.lora.batched import LoRALinear

    path = write_adapter(qwen3_moe_model_dir, tmp_path / "a", targets=("q_proj", "v_proj", "o_proj"))
    model = load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", lora_modules={"a": path})
    assert isinstance(model.layers[0].self_attn.qkv_proj, LoRALinear)
    assert isinstance(model.layers[0].self_attn.o_proj, LoRALinear)


def test_tensor_parallelism_is_refused_before_any_weight_is_read(qwen3_moe_model_dir):
    with pytest.raises(CheckpointError, match="--tensor-parallel-size 2 is not supported for "
                       "mixture-of-experts .*--tensor-parallel-size 1"):
        load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", tp=TensorParallel(0, 2))
