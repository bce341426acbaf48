"""Qwen3.5's TextSpec read by TextModelConfig.from_hf: the hybrid layer types, the linear layers' shape,
partial interleaved M-RoPE, the (1 + w) norms and the attention output gate; the Gated DeltaNet shape
built from it; refused when the family is not in the registry."""

from __future__ import annotations

import json

import pytest

from common.checkpoint import CheckpointError
from common.families import registry
from common.families.qwen3_5 import FAMILY
from common.families.text import FULL, LINEAR
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape


@pytest.fixture
def served() -> None:
    """The family is in the registry (its text backbone is read by TextModelConfig.from_hf)."""
    assert FAMILY in registry.FAMILIES


def test_refused_when_not_served(monkeypatch: pytest.MonkeyPatch, qwen3_5_model_dir):
    monkeypatch.setattr(registry, "FAMILIES", tuple(f for f in registry.FAMILIES if f is not FAMILY))
    text = json.loads((qwen3_5_model_dir / "config.json").read_text())["text_config"]
    with pytest.raises(CheckpointError, match="unsupported language model 'qwen3_5_text'"):
        TextModelConfig.from_hf(text)


def test_the_tiny_checkpoint_s_text_config(served, qwen3_5_model_dir, qwen3_5_oracle):
    text = json.loads((qwen3_5_model_dir / "config.json").read_text())["text_config"]
    cfg = TextModelConfig.from_hf(text)
    hf = qwen3_5_oracle.model.config.text_config
    assert cfg.layer_types == tuple(hf.layer_types) == (LINEAR, LINEAR, LINEAR, FULL)
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.rotary_dims == 16 and cfg.mrope_section == (3, 3, 2) and cfg.mrope_interleaved
    assert cfg.qk_norm and cfg.norm_unit_offset and cfg.attn_output_gate and not cfg.qkv_bias
    shape = GatedDeltaNetShape.from_model_config(cfg)
    assert shape == GatedDeltaNetShape.from_text_config(text) == GatedDeltaNetShape(64, 2, 4, 16, 16, 4)
    # the names the loader will map: HF's linear layer, under our layers.N.linear_attn.
    from decoder_svc.model.loader import rename_language_model_key

    key = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    assert rename_language_model_key(key) == "layers.0.linear_attn.in_proj_qkv.weight"


def test_the_9b_layout_and_refusals(served):
    from common.families.qwen3_5.maker import QWEN3_5_PRESETS, build_qwen3_5_config
    from common.families.qwen3_vl.maker import build_qwen3_tokenizer

    config = build_qwen3_5_config(QWEN3_5_PRESETS["qwen3.5-9b"], build_qwen3_tokenizer(512))
    text = config.text_config.to_dict()
    cfg = TextModelConfig.from_hf(text)
    assert cfg.linear_layers == tuple(i for i in range(32) if i % 4 != 3)
    assert cfg.attention_layers == (3, 7, 11, 15, 19, 23, 27, 31)
    assert cfg.rotary_dims == 64 and cfg.mrope_section == (11, 11, 10)
    assert GatedDeltaNetShape.from_model_config(cfg).recurrent_state_shape(1) == (1, 32, 128, 128)
    # layer types filled in from the interval when a config leaves them out, as HF does
    derived = TextModelConfig.from_hf({**text, "layer_types": None, "full_attention_interval": 2})
    assert derived.attention_layers == tuple(range(1, 32, 2))
    with pytest.raises(CheckpointError, match="layer_types must be 32"):
        TextModelConfig.from_hf({**text, "layer_types": ["sliding_attention"] * 32})
    with pytest.raises(CheckpointError, match="must be 3 sections summing to the rotated dims / 2 = 32"):
        rope = {**text["rope_parameters"], "mrope_section": [24, 20, 20]}
        TextModelConfig.from_hf({**text, "rope_parameters": rope})
    with pytest.raises(CheckpointError, match="not a multiple"):
        TextModelConfig.from_hf({**text, "linear_num_key_heads": 12})


def test_the_state_pool_is_one_tensor_per_kind_and_copies_every_layer_s_slot(served, qwen3_5_model_dir):
    """LinearStatePool.allocate: each layer's slots are views of one tensor per kind (conv, recurrent), so a
    restore (copy_slots) is a few launches for every layer."""
    import torch

    from decoder_svc.model.linear_state import LinearStatePool

    text = json.loads((qwen3_5_model_dir / "config.json").read_text())["text_config"]
    cfg = TextModelConfig.from_hf(text)
    pool = LinearStatePool.allocate(cfg, 4, torch.float32, "cpu")
    conv, recurrent = pool.stacks
    assert conv.shape[0] == recurrent.shape[0] == len(cfg.linear_layers)
    for j, layer in enumerate(cfg.linear_layers):
        assert pool.conv[layer].data_ptr() == conv[j].data_ptr() and pool.conv[layer].is_contiguous()
        assert pool.recurrent[layer].data_ptr() == recurrent[j].data_ptr()
        pool.conv[layer][1].fill_(layer + 1)
        pool.recurrent[layer][1].fill_(-(layer + 1))
    pool.copy_slots([(1, 3)])
    for layer in cfg.linear_layers:
        assert torch.equal(pool.conv[layer][3], pool.conv[layer][1])
        assert torch.equal(pool.recurrent[layer][3], pool.recurrent[layer][1])
        assert not pool.conv[layer][2].any() and not pool.recurrent[layer][0].any()
