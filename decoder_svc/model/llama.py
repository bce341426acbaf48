"""Llama-family decoder layers (Llama, Mistral, Qwen2) over flat token batches and a paged KV cache.

Module and parameter names follow Hugging Face so checkpoint tensors load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoder_svc.model.attention import AttentionBackend, AttentionMetadata
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 and cast back before the weight, as HF does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """GQA self-attention; the backend does the paged-cache part."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q = RotaryEmbedding.apply(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The language model. forward takes all scheduled tokens of a batch as one flat sequence."""

    def __init__(self, cfg: TextModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [tokens, hidden]."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every layer over the flat batch; return fp32 logits only for rows logits_indices."""
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, self.backend)
        # Norm and lm_head only on the rows we sample from: the rest are partial prefill chunks.
        return self.lm_head(self.norm(x[logits_indices])).float()
