"""Gemma 3's language model: q/k norms, norms that scale by (1 + weight), norms after attention and after
the MLP too (sandwich), embeddings scaled by sqrt(hidden), an attention scale from query_pre_attn_scalar,
sliding-window layers with their own rope base among full ones, a tanh-GELU MLP and optional final logit
softcapping. Its language model sits under `model.language_model.` (transformers 5's
Gemma3ForConditionalGeneration), `language_model.model.` (older exports) or at the top level
(Gemma3ForCausalLM); its extra modules (q_norm/k_norm, pre/post_feedforward_layernorm) keep HF's names in
the shared layer, and its output head is tied to the embeddings."""

from __future__ import annotations

from typing import Any

from common.checkpoint import CheckpointError
from common.families.text import FULL, SLIDING, TOP_LEVEL_PREFIXES, TextBackbone, TextSpec


def gemma3_fields(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's rope (the full layers' parameters; the sliding layers' base) and its other fields.
    Rope either as transformers 5 writes it (rope_parameters per layer type) or as config.json files on
    the Hub do (rope_theta, rope_scaling for the full layers, rope_local_base_freq)."""
    if cfg.get("attn_logit_softcapping") is not None:
        # transformers 5 does not apply it for Gemma 3 either; Gemma 2 did. Refuse rather than guess.
        raise CheckpointError("attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError("use_bidirectional_attention (EmbeddingGemma) is not supported")
    if FULL in rope or SLIDING in rope:
        full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:
        full = {**rope, "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise CheckpointError(f"unsupported sliding-layer rope {local!r}; only default frequencies")
    n = cfg["num_hidden_layers"]
    pattern = int(cfg.get("sliding_window_pattern") or 6)  # older configs: every 6th layer global
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise CheckpointError(f"layer_types must be {n} of {SLIDING!r}/{FULL!r}: {types!r}")
    full.setdefault("rope_theta", 1e6)
    return full, dict(
        norm_unit_offset=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        layer_types=tuple(types),
        local_rope_theta=float(local.get("rope_theta", 1e4)),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        sandwich_norms=True,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


GEMMA3 = TextBackbone(name="gemma3", model_types=("gemma3_text", "gemma3"), qk_norm=True,
                      activations=("silu", "gelu_pytorch_tanh"), read_fields=gemma3_fields)

TEXT = TextSpec(
    backbones=(GEMMA3,),
    weight_prefixes=(
        ("model.language_model.", ""),
        ("language_model.model.", ""),
        ("language_model.lm_head.", "lm_head."),
        *TOP_LEVEL_PREFIXES,
    ),
)
