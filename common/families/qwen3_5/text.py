"""Qwen3.5's language model, as data: a hybrid stack whose `layer_types` mix "linear_attention" (Gated
DeltaNet: decoder_svc/model/gated_deltanet.py, its shape in the linear_* fields) and "full_attention"
layers (every `full_attention_interval`-th, 4 by default, as HF fills them in). The attention layers are
Qwen3-Next's: RMSNorm over each head of q and k, a sigmoid gate on the attention output (q_proj gives each
head's query then its gate), a quarter of each head rotated by interleaved M-RoPE whose sections split the
rotated frequencies. Every RMSNorm but the DeltaNet's gated one scales by (1 + weight) in fp32 (Gemma's).
Its checkpoints keep the language model under `model.language_model.` (and MTP weights under `mtp.`, which
no mapping reads). Read by TextModelConfig.from_hf; decoder_svc/model/llama.py runs it.
"""

from __future__ import annotations

from typing import Any

from common.checkpoint import CheckpointError
from common.families.text import FULL, LINEAR, TextBackbone, TextSpec


def qwen3_5_fields(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hybrid stack's layer types and the linear layers' shape, with Qwen3.5's norm and gate."""
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    types = cfg.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise CheckpointError(f"layer_types must be {n} of {LINEAR!r}/{FULL!r}: {types!r}")
    keys, values = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if values % keys:
        raise CheckpointError(f"linear_num_value_heads {values} is not a multiple of linear_num_key_heads "
                              f"{keys}")
    return rope, dict(
        norm_unit_offset=True,
        attn_output_gate=True,
        layer_types=tuple(types),
        linear_num_key_heads=keys,
        linear_num_value_heads=values,
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )


QWEN3_5 = TextBackbone(name="qwen3_5", model_types=("qwen3_5_text", "qwen3_5"), qk_norm=True,
                       partial_rotary=True, partial_mrope=True, read_fields=qwen3_5_fields)

TEXT = TextSpec(backbones=(QWEN3_5,),
                weight_prefixes=(("model.language_model.", ""), ("lm_head.", "lm_head.")))
