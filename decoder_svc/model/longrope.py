"""LongRoPE (Phi-3 / Phi-4-mini, HF rope_type "longrope"): per-frequency rescaling by `short_factor` or
`long_factor`, and cos/sin multiplied by an attention factor.

Which factors HF uses, and why we serve only the short ones
-----------------------------------------------------------
transformers 5.x (modeling_rope_utils): `_compute_longrope_parameters` returns inverse frequencies
``1 / (factors * theta ** (arange(0, dim, 2) / dim))`` with the long factors when its `seq_len` argument
exceeds `original_max_position_embeddings`, else the short ones, and an attention factor that does not
depend on the length: `attention_factor` when the config gives one, else
``sqrt(1 + ln(factor) / ln(original_max))`` with ``factor = rope "factor" or max_position_embeddings /
original_max`` (1 when factor <= 1). Phi4MultimodalRotaryEmbedding.forward is wrapped in
`dynamic_rope_update`, whose `longrope_frequency_update` picks long or short for the whole forward call by
``max(position_ids) + 1 > original_max``; and Phi4MultimodalForCausalLM.prepare_inputs_for_generation drops
the KV cache when the sequence first grows past original_max, so that every cached key is recomputed with
the long factors. HF's rule is therefore: a sequence of at most original_max tokens is rotated with the
short factors everywhere, a longer one with the long factors everywhere, keys of its prefix included.

A paged KV cache cannot do that: keys are written once, rotated at the position they were computed for,
and shared across requests by the prefix cache; switching a sequence to the long factors would mean
recomputing all of its cached keys (and the blocks it shares with others) at the switch. Like several
engines we therefore serve max_model_len = original_max_position_embeddings (4096 for Phi-4-mini) with
the short factors and HF's attention factor, and refuse longer prompts (the engine's length check); that
is HF's behaviour exactly for every sequence we serve.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from common.checkpoint import CheckpointError


def longrope_fields(cfg: dict[str, Any], rope: dict[str, Any], head_dim: int,
                    partial: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rope_scaling we keep for a longrope config (short/long factors, original_max_position_embeddings)
    and the TextModelConfig fields it sets (rope_attention_factor). Refuses factor lists whose length is
    not the number of rotated pairs."""
    original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise CheckpointError("longrope needs original_max_position_embeddings")
    pairs = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        if len(rope.get(key) or ()) != pairs:
            raise CheckpointError(f"longrope {key} must have {pairs} entries (one per rotated pair)")
    factor = rope.get("factor") or cfg["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    kept = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
            "short_factor": [float(x) for x in rope["short_factor"]],
            "long_factor": [float(x) for x in rope["long_factor"]]}
    return kept, {"rope_attention_factor": float(attention)}


def longrope_inv_frequencies(theta: float, dim: int, short_factor: list[float]) -> torch.Tensor:
    """[dim // 2] fp32 inverse frequencies with the short factors, in HF's order of operations."""
    ext = torch.tensor(short_factor, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta ** shape)
