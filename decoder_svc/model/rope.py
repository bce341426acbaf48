"""Rotary position embeddings' inverse frequencies, as Hugging Face computes them (the rotation itself
is ops.rotary over a precomputed cos/sin table)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.longrope import longrope_inv_frequencies


def inv_frequencies(cfg: TextModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dims // 2] in fp32, with linear, llama3 or longrope (its short
    factors: longrope.py says why) scaling applied. Partial rotary: pairs of the rotated dims only."""
    dim = cfg.rotary_dims
    if cfg.rope_type == "longrope":
        return longrope_inv_frequencies(cfg.rope_theta, dim, cfg.rope_scaling["short_factor"])
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif cfg.rope_type == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin_table(cfg: TextModelConfig,
                  make_cache: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """fp32 [max_model_len, rotary_dims]: cat(cos, sin) per position from ops.make_cos_sin_cache, times
    LongRoPE's attention factor (in fp32, as HF scales its cos/sin before casting them)."""
    table = make_cache(inv_frequencies(cfg), cfg.max_model_len)
    return table * cfg.rope_attention_factor if cfg.rope_attention_factor != 1.0 else table
