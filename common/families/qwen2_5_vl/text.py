"""Qwen2.5-VL's language model, Qwen2: q/k/v biases and no output bias whatever attention_bias says, and a
`sliding_window` its configs carry but use only with `use_sliding_window`. Its rope's M-RoPE sections
(`mrope_section`, rope type "mrope") are read by the shared rope parsing. Checkpoints as published keep
the language model at the top level (`model.layers.`, `model.embed_tokens.`, `model.norm.`); transformers 5
saves it under `model.language_model.`."""

from common.families.text import TOP_LEVEL_PREFIXES, TextBackbone, TextSpec

QWEN2 = TextBackbone(name="qwen2", model_types=("qwen2", "qwen2_5_vl_text", "qwen2_5_vl"), qkv_bias=True,
                     o_bias=False, window_switch="use_sliding_window")

TEXT = TextSpec(backbones=(QWEN2,), weight_prefixes=(*TOP_LEVEL_PREFIXES, ("model.language_model.", "")))
