"""Qwen3.5-MoE's language model, as data: Qwen3.5's hybrid stack (Gated DeltaNet layers and gated full
attention, common/families/qwen3_5/text.py) whose every MLP is a mixture of experts with a shared expert:
`num_experts` SwiGLU experts of width `moe_intermediate_size`, `num_experts_per_tok` per token, the
router's top-k probabilities always renormalised (HF's Qwen3_5MoeTopKRouter), beside one shared SwiGLU
expert of width `shared_expert_intermediate_size` scaled by a sigmoid gate (decoder_svc/model/moe.py). Its
checkpoints keep the language model under `model.language_model.`, one module per expert (Qwen2-MoE's
layout, stacked at load)."""

from __future__ import annotations

from typing import Any

from common.checkpoint import CheckpointError
from common.families.qwen3_5.text import qwen3_5_fields
from common.families.qwen3_vl_moe.text import qwen3_moe_fields
from common.families.text import TextBackbone, TextSpec


def qwen3_5_moe_fields(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3.5's hybrid fields, the experts' shape and the shared expert's width."""
    rope, hybrid = qwen3_5_fields(cfg, rope)
    rope, experts = qwen3_moe_fields(cfg, rope)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared <= 0:
        raise CheckpointError("shared_expert_intermediate_size must be positive: every Qwen3.5-MoE layer has "
                              "a shared expert")
    # every layer sparse: no dense width unless the config names one
    return rope, {**hybrid, **experts, "shared_expert_intermediate_size": shared,
                  "intermediate_size": int(cfg.get("intermediate_size") or experts["moe_intermediate_size"])}


QWEN3_5_MOE = TextBackbone(name="qwen3_5_moe", model_types=("qwen3_5_moe_text", "qwen3_5_moe"), qk_norm=True,
                           partial_rotary=True, partial_mrope=True, read_fields=qwen3_5_moe_fields)

TEXT = TextSpec(backbones=(QWEN3_5_MOE,),
                weight_prefixes=(("model.language_model.", ""), ("lm_head.", "lm_head.")))
