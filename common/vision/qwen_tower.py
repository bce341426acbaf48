"""Qwen2.5-VL's vision transformer, several images of any size in one forward.

The patches of every image are concatenated into one sequence; attention stays inside each image (the
full-attention blocks) or inside each 112-px window of it (the other blocks). A video is t temporal groups
(t > 1) of the same size: as in HF's `get_video_features`, every group attends only within itself, and
its windows and rotary positions are those of an image of one group. The math follows Hugging
Face's `Qwen2_5_VisionTransformerPretrainedModel` step by step (Conv3d patch embedding, the 2x2
window reordering, 2D rotary in fp32, RMSNorm, SiLU-gated MLP, the patch merger), so its rows equal
`get_image_features` in fp32. Attention differs only in how it is batched: chunks of equal length
(most windows are full 8x8 patch windows) go through one scaled_dot_product_attention call together
instead of one call each, which is the same arithmetic per chunk and far fewer launches on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Grid = tuple[int, int, int]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm in fp32, cast back before the weight (HF's Qwen2_5_VLRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """2D rotary on q, k [N, heads, head_dim] in fp32, rounded back (HF's apply_rotary_pos_emb_vision)."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    qf, kf = q.float(), k.float()
    return (qf * c + rotate_half(qf) * s).to(q.dtype), (kf * c + rotate_half(kf) * s).to(k.dtype)


class VisionOps:
    """The tower's elementwise steps. Eager by default; `compiled()` fuses each into one kernel with
    torch.compile (GPU), which matters at thousands of patches per image."""

    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)

    @classmethod
    def compiled(cls) -> type[VisionOps]:
        """A VisionOps whose steps are torch.compile'd (dynamic shapes: one compile for any batch)."""
        return type("CompiledVisionOps", (cls,), {
            "rms_norm": staticmethod(torch.compile(rms_norm, dynamic=True)),
            "rotary": staticmethod(torch.compile(rotary, dynamic=True))})


class RMSNorm(nn.Module):
    """RMS norm in fp32, cast back before the weight (HF's Qwen2_5_VLRMSNorm)."""

    ops: type[VisionOps] = VisionOps

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.fused: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def fuse(self, multiple: int = 64) -> None:
        """Gate and up as one product, the hidden width padded with zeros to a multiple of `multiple`.

        Qwen2.5-VL's 3420 is not a multiple of 8 bf16 elements, and cuBLAS then falls back to Ampere
        kernels at a fraction of Hopper's rate. Padded units are exactly zero (silu(0) * 0) and meet zero
        columns of the down projection, so the output is unchanged up to the products' rounding."""
        hidden = self.gate_proj.out_features
        padded = -(-hidden // multiple) * multiple

        def pad_rows(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, padded - hidden)) if t.dim() == 2 else F.pad(t, (0, padded - hidden))

        weight = torch.cat([pad_rows(self.gate_proj.weight), pad_rows(self.up_proj.weight)])
        bias = torch.cat([pad_rows(self.gate_proj.bias), pad_rows(self.up_proj.bias)])
        down = F.pad(self.down_proj.weight, (0, padded - hidden)).contiguous()
        self.fused = (weight.detach(), bias.detach(), down.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        weight, bias, down = self.fused
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down, self.down_proj.bias)


class ChunkPlan:
    """Attention chunks [start, end) of the flat sequence, grouped by length: per group, a [chunks, L]
    index of token rows on the device (built once per forward, used by every block)."""

    def __init__(self, cu_seqlens: Sequence[int], device: torch.device) -> None:
        starts = np.asarray(cu_seqlens[:-1], dtype=np.int64)
        lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
        self.groups: list[torch.Tensor] = []
        for length in np.unique(lengths[lengths > 0]):
            rows = starts[lengths == length][:, None] + np.arange(length)[None, :]
            self.groups.append(torch.from_numpy(rows).to(device, non_blocking=True))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x2, x1) of the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Multi-head attention with 2D rotary, within chunks (images or windows)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    ops: type[VisionOps] = VisionOps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)
        q, k = self.ops.rotary(q, k, cos, sin)
        out = torch.empty_like(q)
        for rows in plan.groups:  # [chunks, L] -> [chunks, heads, L, head_dim]
            qc, kc, vc = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qc, kc, vc, scale=self.head_dim**-0.5).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 block of patches (consecutive rows) through a two-layer GELU MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class QwenVisionTower(nn.Module):
    """Pixel patches of several images (as Qwen2VLImageProcessor lays them out) to merged embeddings."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.dim = int(vision["hidden_size"])
        self.num_heads = int(vision.get("num_heads", vision.get("num_attention_heads")))
        self.patch = int(vision.get("patch_size", 14))
        self.temporal = int(vision.get("temporal_patch_size", 2))
        self.merge = int(vision.get("spatial_merge_size", 2))
        self.channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
        self.window = int(vision.get("window_size", 112))
        self.full_blocks = frozenset(int(i) for i in vision.get("fullatt_block_indexes", ()))
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision hidden_act {vision.get('hidden_act')!r} is not supported; only silu")
        depth = int(vision.get("depth", vision.get("num_hidden_layers")))
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, self.dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.num_heads, int(vision["intermediate_size"]))
                                    for _ in range(depth))
        self.merger = PatchMerger(int(vision["out_hidden_size"]), self.dim, self.merge)
        self.register_buffer("inv_freq", self.rotary_inv_freq(vision), persistent=False)

    @staticmethod
    def rotary_inv_freq(vision: dict) -> torch.Tensor:
        """fp32 inverse frequencies of the 2D rotary: head_dim / 4 of them, shared by h and w."""
        theta = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        heads = int(vision.get("num_heads", vision.get("num_attention_heads")))
        quarter = int(vision["hidden_size"]) // heads // 2
        return 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    def use_ops(self, ops: type[VisionOps]) -> None:
        """Run the elementwise steps with ops (VisionOps, or VisionOps.compiled() on a GPU)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, VisionAttention)):
                module.ops = ops

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values (channels x temporal x patch x patch)."""
        return self.channels * self.temporal * self.patch * self.patch

    def layout(self, grids: Sequence[Grid]) -> tuple[np.ndarray, list[int], list[int], np.ndarray]:
        """Host-side plan of a batch: the window order of merge units, window and full-attention chunk
        bounds (cu_seqlens, in patches: one chunk per image, per temporal group of a video), and the (h, w)
        position of every patch in window order."""
        unit = self.merge * self.merge
        win = self.window // self.merge // self.patch  # merge units per window side
        order, cu_window, cu_image, positions = [], [0], [0], []
        base = 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = np.arange(t * gh * gw).reshape(t, gh, gw)
            pad_h, pad_w = -gh % win, -gw % win
            padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
            nh, nw = padded.shape[1] // win, padded.shape[2] // win
            padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4)
            padded = padded.reshape(t, nh * nw, win * win)
            for window in padded.reshape(-1, win * win):
                units = window[window >= 0]
                if units.size:
                    order.append(units + base)
                    cu_window.append(cu_window[-1] + units.size * unit)
            # (h, w) of each patch, merge blocks contiguous (the processor's patch order).
            hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            shape = (gh, self.merge, gw, self.merge)
            hw = np.stack([hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
                           wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)], axis=1)
            positions.append(np.tile(hw, (t, 1)))
            base += t * gh * gw
            # Full attention stays inside each temporal group of a video (HF's get_vision_cu_seqlens: one
            # chunk of h*w patches per frame group); a group's windows are contiguous in window order.
            for _ in range(t):
                cu_image.append(cu_image[-1] + h * w)
        window_order = np.concatenate(order)
        pos = np.concatenate(positions).reshape(-1, unit, 2)[window_order].reshape(-1, 2)
        return window_order, cu_window, cu_image, pos

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Merged embeddings [sum of t*h*w/4, out_hidden] for pixel_values [sum of t*h*w, patch_dim]."""
        device, unit = pixel_values.device, self.merge * self.merge
        window_order, cu_window, cu_image, pos = self.layout(grids)
        weight = self.patch_embed.proj.weight
        if pixel_values.is_cuda:
            # The Conv3d's stride equals its kernel: one matrix product over flattened patches, which
            # cuDNN's 3D convolutions do far slower (the same sums; rounding may differ in bf16).
            x = F.linear(pixel_values.to(weight.dtype), weight.view(self.dim, -1))
        else:
            x = self.patch_embed.proj(pixel_values.view(-1, self.channels, self.temporal, self.patch,
                                                        self.patch).to(weight.dtype)).view(-1, self.dim)
        n = x.shape[0]
        order = torch.from_numpy(window_order).to(device, non_blocking=True)
        x = x.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        freqs = torch.from_numpy(pos).to(device, non_blocking=True)[..., None].float() * self.inv_freq
        emb = freqs.reshape(n, -1)  # cat(h frequencies, w frequencies)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        plans = {False: ChunkPlan(cu_window, device), True: ChunkPlan(cu_image, device)}
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plans[i in self.full_blocks])
        merged = self.merger(x)
        return merged[torch.argsort(order)]


_PREFIXES = ("model.visual.", "visual.")


def load_qwen_tower(model_dir, vision: dict, device: torch.device, dtype: torch.dtype) -> QwenVisionTower:
    """The tower with the checkpoint's `visual.*` (or `model.visual.*`) weights, strictly."""
    from common.checkpoint import load_tensors

    tensors = load_tensors(model_dir, _PREFIXES)
    state = {}
    for name, tensor in tensors.items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                state[name[len(prefix):]] = tensor
                break
    with torch.device("meta"):
        tower = QwenVisionTower(vision)
    tower = tower.to_empty(device="cpu")
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: vision tower weights do not match: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    tower = tower.to(device, dtype).eval()
    if torch.device(device).type == "cuda":
        for block in tower.blocks:  # aligned GEMMs on the GPU (CPU keeps HF's exact products)
            block.mlp.fuse()
    # Computed, not in the checkpoint, and kept in fp32 whatever the weights' dtype (as HF computes it).
    tower.inv_freq = QwenVisionTower.rotary_inv_freq(vision).to(device)
    return tower
