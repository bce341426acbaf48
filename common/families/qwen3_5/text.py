"""Qwen3.5's language model, as data: a hybrid stack (`layer_types`: "linear_attention" Gated DeltaNet
layers, "full_attention" gated attention layers) under `model.language_model.` (read by no engine yet)."""

from common.families.text import TextBackbone, TextSpec

QWEN3_5 = TextBackbone(name="qwen3_5", model_types=("qwen3_5_text", "qwen3_5"), qk_norm=True,
                       partial_rotary=True)

TEXT = TextSpec(backbones=(QWEN3_5,),
                weight_prefixes=(("model.language_model.", ""), ("lm_head.", "lm_head.")))
