"""The Qwen3.5-MoE family: its presets (qwen3.5-35b-a3b with the shapes transformers documents for
Qwen/Qwen3.5-35B-A3B), its text fields (a shared expert required), and the loader stacking the experts'
one-module-each checkpoint tensors."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import CheckpointError
from common.families import family_for_preset, family_of, preset_names
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.moe import stack_expert_modules


def _config(name: str):
    from transformers import Qwen3_5MoeConfig

    from common.families.qwen3_5.maker import build_qwen3_5_config
    from common.families.qwen3_5_moe.maker import QWEN3_5_MOE_PRESETS
    from common.families.qwen3_vl.maker import build_qwen3_tokenizer

    return build_qwen3_5_config(QWEN3_5_MOE_PRESETS[name], build_qwen3_tokenizer(512, 0), Qwen3_5MoeConfig)


def test_the_presets_are_the_familys():
    assert {"qwen3.5-moe-tiny", "qwen3.5-35b-a3b"} <= set(preset_names())
    assert family_for_preset("qwen3.5-35b-a3b").name == "qwen3_5_moe"
    assert family_of({"model_type": "qwen3_5_moe"}).name == "qwen3_5_moe"


def test_35b_a3b_has_the_documented_shapes():
    from transformers import Qwen3_5MoeConfig

    config, documented = _config("qwen3.5-35b-a3b"), Qwen3_5MoeConfig().text_config
    text = TextModelConfig.from_hf(config.text_config.to_dict())
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "vocab_size"):
        assert getattr(config.text_config, name) == getattr(documented, name), name
    assert len(text.attention_layers) == 10 and len(text.linear_layers) == 30
    assert all(text.layer_is_moe(i) for i in range(text.num_layers)) and text.moe_renormalize
    assert text.shared_expert_intermediate_size == 512 and text.rotary_dims == 64
    assert text.mrope_section == (11, 11, 10) and text.mrope_interleaved
    assert config.vision_config.out_hidden_size == 2048 and config.vision_config.depth == 27


def test_a_config_without_a_shared_expert_is_refused():
    text = _config("qwen3.5-moe-tiny").text_config.to_dict()
    text["shared_expert_intermediate_size"] = 0
    with pytest.raises(CheckpointError, match="shared_expert_intermediate_size"):
        TextModelConfig.from_hf(text)


def test_one_module_per_expert_is_stacked_gate_rows_then_up_rows():
    experts, inter, hidden = 3, 2, 4
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    weights = {(e, p): torch.randn(shape) for e in range(experts) for p, shape in shapes.items()}
    prefix = "layers.0.mlp.experts."
    state = {f"{prefix}{e}.{p}.weight": w for (e, p), w in weights.items()}
    state["layers.0.mlp.gate.weight"] = torch.randn(experts, hidden)
    stack_expert_modules(state, experts)
    assert sorted(state) == ["layers.0.mlp.experts.down_proj", "layers.0.mlp.experts.gate_up_proj",
                             "layers.0.mlp.gate.weight"]
    for e in range(experts):
        assert torch.equal(state[prefix + "gate_up_proj"][e, :inter], weights[(e, "gate_proj")])
        assert torch.equal(state[prefix + "gate_up_proj"][e, inter:], weights[(e, "up_proj")])
        assert torch.equal(state[prefix + "down_proj"][e], weights[(e, "down_proj")])
    missing = {f"{prefix}{e}.{p}.weight": w for (e, p), w in weights.items() if e != 1}
    with pytest.raises(ValueError, match="2 of the 3 experts"):
        stack_expert_modules(missing, experts)
