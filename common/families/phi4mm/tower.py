"""Phi-4-multimodal's vision tower: a SigLIP encoder over 448 px crops whose patch positions follow each
crop's patch mask (NaViT-style buckets), cut at `feature_layer`, then 2x2 average pooling.

This is HF's Phi4MultimodalVisionModel as Phi4MultimodalImageEmbedding.get_img_features uses it:
- positions: a crop whose mask keeps nb_h x nb_w patches has its kept patches' positions spread over the
  whole 32 x 32 table (bucketize of i / nb over 1/32 steps); masked patches take position 0;
- attention: every patch attends to the kept patches of its crop (padding is masked as keys only; the
  padding patches' own outputs still feed the pooling where a compressed token straddles the border);
- the hidden state of `feature_layer` (-2: the output of the last layer but one, before post_layernorm):
  the layers after it, the post-LayerNorm and the pooling head are not built;
- AvgPool2d(2) over the patch grid (reflection-padded by one first where the grid is odd).

Parameter names are HF's under `img_processor.` (embeddings.*, encoder.layers.N.*), so the checkpoint's
tensors load as they are.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class PatchEmbeddings(nn.Module):
    """Conv patch embedding plus the mask-dependent bucketed position embedding."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int = 3) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.per_side = image_size // patch_size
        self.patch_embedding = nn.Conv2d(channels, hidden, patch_size, patch_size)
        self.position_embedding = nn.Embedding(self.per_side ** 2, hidden)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[crops, h * w] position ids of the patches of crops whose kept patches are patch_mask
        (bool [crops, h, w]); HF's float32 arithmetic, so the same buckets at every boundary."""
        crops, h, w = patch_mask.shape
        device = patch_mask.device
        n = self.per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)
        step_h = 1.0 / patch_mask[:, :, 0].sum(dim=1)
        step_w = 1.0 / patch_mask[:, 0, :].sum(dim=1)
        frac_h = torch.arange(h, device=device, dtype=torch.float32)[None, :] * step_h[:, None]
        frac_w = torch.arange(w, device=device, dtype=torch.float32)[None, :] * step_w[:, None]
        bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
        ids = (bucket_h[:, :, None] * n + bucket_w[:, None, :]).reshape(crops, -1)
        return torch.where(patch_mask.reshape(crops, -1), ids, torch.zeros_like(ids))

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return embeds + self.position_embedding(self.position_ids(patch_mask))


class EncoderLayer(nn.Module):
    """SigLIP's pre-norm layer (LayerNorm, attention, LayerNorm, tanh-GELU MLP), HF's parameter names."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(hidden, hidden))
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, intermediate)
        self.mlp.fc2 = nn.Linear(intermediate, hidden)

    def fuse_qkv(self) -> None:
        """One [3 * hidden, hidden] product for q, k and v (after the checkpoint's tensors are loaded under
        HF's names): one GEMM instead of three, its output read by the attention in place."""
        attn = self.self_attn
        parts = [getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")]
        attn.qkv = nn.Linear(parts[0].in_features, 3 * parts[0].out_features, device=parts[0].weight.device,
                             dtype=parts[0].weight.dtype)
        with torch.no_grad():
            attn.qkv.weight.copy_(torch.cat([p.weight for p in parts]))
            attn.qkv.bias.copy_(torch.cat([p.bias for p in parts]))
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        attn = self.self_attn
        h = self.layer_norm1(x)
        q, k, v = attn.qkv(h).view(batch, seq, 3, self.heads, -1).unbind(2)  # load_phi4_embedder fused them
        # [batch, heads, seq, dim] views of token-major rows; the output comes back token-major
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=key_mask)
        x = x + attn.out_proj(o.transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))
        return x + h


class Encoder(nn.Module):
    """The kept layers under HF's `encoder.layers.N` names."""

    def __init__(self, layers: list[EncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Phi4VisionTower(nn.Module):
    """Crops [N, 3, S, S] and their patch masks [N, S/p, S/p] to pooled features [N, (S/2p)^2, hidden]."""

    def __init__(self, hidden: int, intermediate: int, heads: int, layers_kept: int, image_size: int,
                 patch_size: int, eps: float) -> None:
        super().__init__()
        self.embeddings = PatchEmbeddings(hidden, image_size, patch_size)
        self.encoder = Encoder([EncoderLayer(hidden, intermediate, heads, eps) for _ in range(layers_kept)])
        self.patches_per_side = image_size // patch_size

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        patch_mask = patch_mask.to(torch.bool)
        x = self.embeddings(pixel_values, patch_mask)
        # keys of padding patches are masked; a crop without padding needs no mask (and none is passed for
        # a batch without any, so SDPA may take its fastest kernel)
        keys = patch_mask.reshape(x.shape[0], 1, 1, -1)
        key_mask = None if bool(keys.all()) else keys
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return pool_2x2(x, self.patches_per_side)


def pool_2x2(features: torch.Tensor, side: int) -> torch.Tensor:
    """[N, side^2, C] patch features to [N, ceil(side/2)^2, C]: HF's reflection pad (odd side) and
    AvgPool2d(2), row-major."""
    n, _, c = features.shape
    grid = features.view(n, side, side, c).permute(0, 3, 1, 2)
    if side % 2:
        grid = F.pad(grid, (0, 1, 0, 1), mode="reflect")
    pooled = F.avg_pool2d(grid, kernel_size=2, stride=2)
    return pooled.permute(0, 2, 3, 1).reshape(n, -1, c)


def layers_kept(num_layers: int, feature_layer: int) -> int:
    """Encoder layers that feed hidden_states[feature_layer] (index 0: the embeddings)."""
    index = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= index <= num_layers:
        raise ValueError(f"feature_layer {feature_layer} is outside 0..{num_layers}")
    return index


def tokens_side(image_size: int, patch_size: int) -> int:
    """Compressed tokens per crop side (16 at 448 px, patch 14)."""
    return math.ceil(image_size // patch_size / 2)
