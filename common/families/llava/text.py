"""LLaVA's language models: Llama and Mistral (this backbone: Llama's layers, the config's attention_bias
for all four projections), and Qwen2 (LLaVA-Interleave; Qwen2.5-VL's backbone, reused). Its checkpoints
keep the language model under `language_model.model.` / `language_model.lm_head.` (older
LlavaForConditionalGeneration exports, and our maker) or `model.language_model.` / `lm_head.` (newer)."""

from common.families.qwen2_5_vl.text import QWEN2
from common.families.text import DEFAULT_TEXT_MODEL_TYPE, TextBackbone, TextSpec

# Mistral's window on every layer is served by capping the length at it (TextModelConfig.max_model_len).
LLAMA = TextBackbone(name="llama", model_types=(DEFAULT_TEXT_MODEL_TYPE, "mistral"))

TEXT = TextSpec(
    backbones=(LLAMA, QWEN2),
    weight_prefixes=(
        ("language_model.model.", ""),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", ""),
        ("lm_head.", "lm_head."),
    ),
)
