"""Qwen3-VL-MoE's language model, Qwen3-MoE: Qwen3-VL's attention (per-head q/k norms, interleaved M-RoPE)
with a mixture-of-experts MLP in every layer but those `mlp_only_layers` names or `decoder_sparse_step`
skips (HF's rule: layer i is sparse when (i + 1) % step == 0). HF's router (Qwen3VLMoeTextTopKRouter)
always renormalises the top-k probabilities, the released checkpoints' `norm_topk_prob: true`; a config
saying false is refused rather than served otherwise than HF computes it. Its checkpoints keep the
language model under `model.language_model.` (the experts stacked: decoder_svc/model/moe.py)."""

from __future__ import annotations

from typing import Any

from common.checkpoint import CheckpointError
from common.families.text import TextBackbone, TextSpec


def qwen3_moe_fields(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The experts' shape and which layers are dense. HF 5.x saves num_experts as num_local_experts (its
    attribute map); the released checkpoints say num_experts."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise CheckpointError(f"num_experts {experts} / num_experts_per_tok {top_k}: a MoE stack needs "
                              "1 <= num_experts_per_tok <= num_experts")
    if cfg.get("norm_topk_prob", True) is False:
        raise CheckpointError("norm_topk_prob false: HF's Qwen3-VL-MoE renormalises the top-k weights")
    layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return rope, dict(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=int(cfg["moe_intermediate_size"]), moe_renormalize=True,
                      dense_mlp_layers=dense)


QWEN3_MOE = TextBackbone(name="qwen3_moe", model_types=("qwen3_vl_moe_text", "qwen3_vl_moe"), qk_norm=True,
                         window_switch="use_sliding_window", read_fields=qwen3_moe_fields)

TEXT = TextSpec(backbones=(QWEN3_MOE,),
                weight_prefixes=(("model.language_model.", ""), ("lm_head.", "lm_head.")))
