"""Phi-4-multimodal's language model, Phi-4-mini: Llama's layers with partial rotary embeddings
(partial_rotary_factor 0.75: the first rotary_dim dims of each head rotate) and LongRoPE (rope type
"longrope", read by the shared rope parsing, decoder_svc/model/longrope.py). Its layers store `qkv_proj`
and `gate_up_proj` fused already, in the shared layer's q|k|v and gate|up row order, so its tensors keep
their names; the language model sits at the checkpoint's top level, and `model.embed_tokens_extend.*` (the
vision and audio towers) matches none of its prefixes. Its LoRA tensors (PEFT's `base_layer` /
`lora_A` / `lora_B` naming) are the loader's concern: the base weight is read, the adapters are not."""

from common.families.text import TOP_LEVEL_PREFIXES, TextBackbone, TextSpec

PHI4_MINI = TextBackbone(name="phi4_mini", model_types=("phi4_multimodal",), partial_rotary=True)

TEXT = TextSpec(backbones=(PHI4_MINI,), weight_prefixes=TOP_LEVEL_PREFIXES)
