"""Rotary position embeddings' inverse frequencies, as Hugging Face computes them (the rotation itself
is ops.rotary over a precomputed cos/sin table)."""

from __future__ import annotations

import math

import torch

from decoder_svc.model.config import TextModelConfig


def inv_frequencies(cfg: TextModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in fp32, with linear or llama3 scaling applied."""
    dim = cfg.head_dim
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
