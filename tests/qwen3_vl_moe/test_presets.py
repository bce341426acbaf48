"""The Qwen3-VL-MoE presets: qwen3-vl-30b-a3b has Qwen3-VL-30B-A3B's shapes (its published 30.5B parameters,
3.3B active), which transformers' defaults are not; qwen3-vl-moe-tiny spreads tokens over its experts."""

from __future__ import annotations

import torch

from common.families import family_for_preset, family_of, preset_names
from decoder_svc.model.config import TextModelConfig


def _config(name: str):
    from transformers import Qwen3VLMoeConfig

    from common.families.qwen3_vl.maker import build_qwen3_config, build_qwen3_tokenizer
    from common.families.qwen3_vl_moe.maker import QWEN3_MOE_PRESETS

    spec = QWEN3_MOE_PRESETS[name]
    return build_qwen3_config(spec, build_qwen3_tokenizer(512, 0), Qwen3VLMoeConfig)


def test_the_presets_are_the_familys():
    assert {"qwen3-vl-moe-tiny", "qwen3-vl-30b-a3b"} <= set(preset_names())
    assert family_for_preset("qwen3-vl-30b-a3b").name == "qwen3_vl_moe"
    assert family_of({"model_type": "qwen3_vl_moe"}).name == "qwen3_vl_moe"


def test_30b_a3b_has_the_real_shapes():
    config = _config("qwen3-vl-30b-a3b")
    assert config.model_type == "qwen3_vl_moe"
    text = TextModelConfig.from_hf(config.text_config.to_dict())
    assert (text.hidden_size, text.num_layers, text.num_heads, text.num_kv_heads, text.head_dim) == \
        (2048, 48, 32, 4, 128)
    assert (text.num_experts, text.moe_intermediate_size, text.num_experts_per_tok) == (128, 768, 8)
    assert text.moe_renormalize and not text.dense_mlp_layers and not text.tie_word_embeddings
    assert text.mrope_section == (24, 20, 20) and text.mrope_interleaved and text.rope_theta == 5e6
    vision = config.vision_config
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (27, 1152, 2048)
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24]
    # The language model's parameters: 30.5B in all, 3.3B read per token (8 of 128 experts).
    h, layers, vocab = text.hidden_size, text.num_layers, text.vocab_size
    attention = h * (2 * text.num_heads + 2 * text.num_kv_heads) * text.head_dim  # q, k, v and o
    expert = 3 * h * text.moe_intermediate_size
    shared = layers * (attention + text.num_experts * h) + 2 * vocab * h  # with the routers and embeddings
    assert round((shared + layers * text.num_experts * expert) / 1e9, 1) == 30.5
    assert 3.3 <= (shared + layers * text.num_experts_per_tok * expert) / 1e9 < 3.4


def test_the_tiny_router_spreads_tokens_over_the_experts(qwen3_moe_oracle):
    """The maker's router scale: a short prompt's tokens reach most experts in every layer (random
    weights at the usual 0.02 would send them all to the same few)."""
    hf = qwen3_moe_oracle.model
    ids = qwen3_moe_oracle.tokenizer("describe a red car on the table, then a blue one", return_tensors="pt")
    hits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: hits.append(out[2].unique().numel()))
             for layer in hf.model.language_model.layers]
    with torch.no_grad():
        hf(**ids)
    for hook in hooks:
        hook.remove()
    experts = hf.config.text_config.num_experts
    assert len(hits) == hf.config.text_config.num_hidden_layers and min(hits) >= experts * 3 // 4
