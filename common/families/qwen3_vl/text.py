"""Qwen3-VL's language model, Qwen3: Llama's projections (attention_bias) with RMSNorm over each head of q
and k, a `sliding_window` used only with `use_sliding_window`, and interleaved M-RoPE (`mrope_interleaved`,
read by the shared rope parsing). Its checkpoints keep the language model under `model.language_model.`."""

from common.families.text import TextBackbone, TextSpec

QWEN3 = TextBackbone(name="qwen3", model_types=("qwen3_vl_text", "qwen3_vl"), qk_norm=True,
                     window_switch="use_sliding_window")

TEXT = TextSpec(backbones=(QWEN3,), weight_prefixes=(("model.language_model.", ""), ("lm_head.", "lm_head.")))
