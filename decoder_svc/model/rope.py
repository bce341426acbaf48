"""Rotary position embeddings, computed exactly as Hugging Face Llama does (fp32 angles)."""

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


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flat [tokens, heads, head_dim] queries and keys at arbitrary positions."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim] for these positions, cast to the model dtype like HF."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
