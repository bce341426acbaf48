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

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.vision.attention import AttentionSpans, flash_supported

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
    """The tower's elementwise steps. Eager by default (HF's operations, bit-equal in fp32); `fused()`
    runs each as one Triton kernel (GPU: common/kernels/vision_fused_ops.py), `compiled()` fuses them with
    torch.compile instead."""

    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)

    @classmethod
    def rotary_qkv(cls, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) [N, heads, head_dim] from the qkv product [N, 3, heads, head_dim], q and k rotated."""
        q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
        q, k = cls.rotary(q, k, cos, sin)
        return q, k, v

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMS norm): a residual add and the next pre-norm."""
        x = x + delta
        return x, cls.rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up over the two halves of the fused gate/up product."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def compiled(cls) -> type[VisionOps]:
        """A VisionOps whose steps are torch.compile'd (dynamic shapes: one compile for any batch)."""
        return type("CompiledVisionOps", (cls,), {
            "rms_norm": staticmethod(torch.compile(rms_norm, dynamic=True)),
            "rotary": staticmethod(torch.compile(rotary, dynamic=True))})

    @classmethod
    def fused(cls) -> type[VisionOps]:
        """A VisionOps whose rotary (with the q/k/v split), residual add + RMS norm and SiLU-gate run as
        one Triton kernel each (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1)."""
        from common.kernels import vision_fused_ops as fused_ops

        return type("FusedVisionOps", (cls,), {
            "rotary_qkv": staticmethod(fused_ops.rotary_qkv),
            "rms_norm": staticmethod(lambda x, weight, eps: fused_ops.add_rms_norm(x, None, weight, eps)[1]),
            "add_rms_norm": staticmethod(fused_ops.add_rms_norm),
            "silu_mul": staticmethod(fused_ops.silu_mul)})


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
        # fuse(): gate and up as one product, and the down projection, over a padded hidden width
        self.fused_gate_up: nn.Module | None = None
        self.fused_down: nn.Module | None = None

    ops: type[VisionOps] = VisionOps

    @torch.no_grad()
    def fuse(self, multiple: int = 64) -> None:
        """Gate and up as one product, the hidden width padded with zeros to a multiple of `multiple`.

        Qwen2.5-VL's 3420 is not a multiple of 8 bf16 elements, and cuBLAS then falls back to Ampere
        kernels at a fraction of Hopper's rate. Padded units are exactly zero (silu(0) * 0) and meet zero
        columns of the down projection, so the output is unchanged up to the products' rounding. The
        fused layers are modules of their own (an FP8 tower quantizes them: common/vision/fp8.py)."""
        dim, hidden = self.gate_proj.in_features, self.gate_proj.out_features
        padded = -(-hidden // multiple) * multiple

        def pad_rows(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, padded - hidden)) if t.dim() == 2 else F.pad(t, (0, padded - hidden))

        weight = self.gate_proj.weight
        gate_up = nn.Linear(dim, 2 * padded, device=weight.device, dtype=weight.dtype)
        gate_up.weight.copy_(torch.cat([pad_rows(self.gate_proj.weight), pad_rows(self.up_proj.weight)]))
        gate_up.bias.copy_(torch.cat([pad_rows(self.gate_proj.bias), pad_rows(self.up_proj.bias)]))
        down = nn.Linear(padded, dim, device=weight.device, dtype=weight.dtype)
        down.weight.copy_(F.pad(self.down_proj.weight, (0, padded - hidden)))
        down.bias.copy_(self.down_proj.bias)
        self.fused_gate_up, self.fused_down = gate_up.requires_grad_(False), down.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.fused_down(self.ops.silu_mul(self.fused_gate_up(x)))


def use_ops(tower: nn.Module, ops: type) -> None:
    """Give every module of the tower that runs elementwise steps (an `ops` class attribute) `ops`."""
    for module in tower.modules():
        if hasattr(type(module), "ops"):
            module.ops = ops


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x2, x1) of the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Multi-head attention with 2D rotary, within spans (images, frame groups or windows)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    ops: type[VisionOps] = VisionOps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: AttentionSpans
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.ops.rotary_qkv(self.qkv(x).view(n, 3, self.num_heads, self.head_dim), cos, sin)
        out = spans.attend(q, k, v, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    ops: type[VisionOps] = VisionOps

    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: AttentionSpans
                ) -> torch.Tensor:
        x, h = self.ops.add_rms_norm(x, self.attn(self.norm1(x), cos, sin, spans), self.norm2.weight,
                                     self.norm2.eps)
        return x + self.mlp(h)


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


class QwenPatchTower(nn.Module):
    """What the Qwen-VL towers (Qwen2.5-VL's here, Qwen3-VL's) share: the patch geometry read from the
    vision config, the Conv3d patch embedding whose stride is its kernel, and the 2D rotary frequencies."""

    def __init__(self, vision: dict, default_patch: int, patch_bias: bool) -> None:
        super().__init__()
        self.dim = int(vision["hidden_size"])
        self.num_heads = int(vision.get("num_heads", vision.get("num_attention_heads")))
        self.patch = int(vision.get("patch_size", default_patch))  # 14 px in Qwen2.5-VL, 16 in Qwen3-VL
        self.temporal = int(vision.get("temporal_patch_size", 2))
        self.merge = int(vision.get("spatial_merge_size", 2))
        self.channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, self.dim, kernel, stride=kernel, bias=patch_bias)
        self.register_buffer("inv_freq", self.rotary_inv_freq(vision), persistent=False)

    @staticmethod
    def rotary_inv_freq(vision: dict) -> torch.Tensor:
        """fp32 inverse frequencies of the 2D rotary: head_dim / 4 of them, shared by h and w."""
        theta = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        heads = int(vision.get("num_heads", vision.get("num_attention_heads")))
        quarter = int(vision["hidden_size"]) // heads // 2
        return 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    def use_ops(self, ops: type[VisionOps]) -> None:
        """Run the elementwise steps with ops (the tower's VisionOps class, or its fused() or compiled()
        form on a GPU)."""
        use_ops(self, ops)

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values (channels x temporal x patch x patch)."""
        return self.channels * self.temporal * self.patch * self.patch


class QwenVisionTower(QwenPatchTower):
    """Pixel patches of several images (as Qwen2VLImageProcessor lays them out) to merged embeddings."""

    # Varlen FlashAttention where it runs (CUDA, half precision); False: the SDPA reference everywhere.
    flash_attention = True

    def __init__(self, vision: dict) -> None:
        super().__init__(vision, default_patch=14, patch_bias=False)
        self.window = int(vision.get("window_size", 112))
        self.full_blocks = frozenset(int(i) for i in vision.get("fullatt_block_indexes", ()))
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision hidden_act {vision.get('hidden_act')!r} is not supported; only silu")
        depth = int(vision.get("depth", vision.get("num_hidden_layers")))
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.num_heads, int(vision["intermediate_size"]))
                                    for _ in range(depth))
        self.merger = PatchMerger(int(vision["out_hidden_size"]), self.dim, self.merge)

    def layout(self, grids: Sequence[Grid]) -> tuple[np.ndarray, list[int], list[int], np.ndarray]:
        """Host-side plan of a batch: the window order of merge units, window and full-attention chunk
        bounds (cu_seqlens, in patches: one chunk per image, per temporal group of a video), and the (h, w)
        position of every patch in window order. Each grid's part is computed once and cached."""
        win = self.window // self.merge // self.patch  # merge units per window side
        parts = [grid_windows(self.merge, win, *grid) for grid in grids]
        bases = np.cumsum([0] + [len(order) for order, _, _ in parts[:-1]])
        window_order = np.concatenate([part[0] + base for part, base in zip(parts, bases, strict=True)])
        cu_window = np.concatenate([[0], np.cumsum(np.concatenate([lengths for _, lengths, _ in parts]))])
        # Full attention stays inside each temporal group of a video (HF's get_vision_cu_seqlens: one
        # chunk of h*w patches per frame group); a group's windows are contiguous in window order.
        cu_image = np.concatenate([[0], np.cumsum([h * w for t, h, w in grids for _ in range(t)])])
        pos = np.concatenate([positions for _, _, positions in parts])
        return window_order, cu_window.tolist(), cu_image.tolist(), pos

    def plan(self, grids: Sequence[Grid], device: torch.device, dtype: torch.dtype) -> QwenTowerPlan:
        """Everything a forward over these grids needs besides the pixels, on `device` (activations of
        `dtype`): the window order and its inverse, the rotary tables and both attention spans."""
        window_order, cu_window, cu_image, pos = self.layout(grids)
        n = len(pos)
        order = torch.from_numpy(window_order).to(device, non_blocking=True)
        restore = np.empty_like(window_order)
        restore[window_order] = np.arange(len(window_order))
        freqs = torch.from_numpy(pos).to(device, non_blocking=True)[..., None].float() * self.inv_freq
        emb = freqs.reshape(n, -1)  # cat(h frequencies, w frequencies)
        emb = torch.cat((emb, emb), dim=-1)
        flash = self.flash_attention and flash_supported(device, dtype, self.dim // self.num_heads)
        return QwenTowerPlan(order, torch.from_numpy(restore).to(device, non_blocking=True), emb.cos(),
                             emb.sin(), AttentionSpans.from_bounds(cu_window, device, flash),
                             AttentionSpans.from_bounds(cu_image, device, flash))

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Merged embeddings [sum of t*h*w/4, out_hidden] for pixel_values [sum of t*h*w, patch_dim]."""
        dtype = self.patch_embed.proj.weight.dtype
        return self.run(pixel_values, self.plan(grids, pixel_values.device, dtype))

    def run(self, pixel_values: torch.Tensor, plan: QwenTowerPlan) -> torch.Tensor:
        """forward() with its plan made: device work only (what a CUDA graph captures)."""
        unit = self.merge * self.merge
        weight = self.patch_embed.proj.weight
        if pixel_values.is_cuda:
            # The Conv3d's stride equals its kernel: one matrix product over flattened patches, which
            # cuDNN's 3D convolutions do far slower (the same sums; rounding may differ in bf16).
            x = F.linear(pixel_values.to(weight.dtype), weight.view(self.dim, -1))
        else:
            x = self.patch_embed.proj(pixel_values.view(-1, self.channels, self.temporal, self.patch,
                                                        self.patch).to(weight.dtype)).view(-1, self.dim)
        n = x.shape[0]
        x = x.reshape(n // unit, unit, -1)[plan.order].reshape(n, -1)
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.full_spans if i in self.full_blocks else plan.window_spans)
        return self.merger(x)[plan.restore]


@dataclass(frozen=True)
class QwenTowerPlan:
    """A batch's layout on the device (QwenVisionTower.plan): the window order of merge units and its
    inverse, cos/sin of the 2D rotary per patch, the window spans and the full-attention spans."""

    order: torch.Tensor
    restore: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    window_spans: AttentionSpans
    full_spans: AttentionSpans


@functools.lru_cache(maxsize=512)
def grid_windows(merge: int, win: int, t: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's (or video's) part of a batch plan: the window order of its merge units (local indices),
    its windows' lengths in patches, and the (h, w) position of each patch in window order. HF's
    get_window_index: the grid of merge units padded to whole windows of win x win units, windows taken
    row by row, the units of each window row by row, padding dropped (a window may come out empty)."""
    unit = merge * merge
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    padded = np.pad(index, ((0, 0), (0, -gh % win), (0, -gw % win)), constant_values=-1)
    nh, nw = padded.shape[1] // win, padded.shape[2] // win
    windows = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(-1, win * win)
    valid = windows >= 0
    order = windows[valid]
    lengths = valid.sum(axis=1)
    lengths = lengths[lengths > 0] * unit
    # (h, w) of each patch, merge blocks contiguous (the processor's patch order), then in window order.
    hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (gh, merge, gw, merge)
    hw = np.stack([hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
                   wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)], axis=1)
    positions = np.tile(hw, (t, 1)).reshape(-1, unit, 2)[order].reshape(-1, 2)
    for array in (order, lengths, positions):
        array.flags.writeable = False  # shared by every batch with this grid
    return order, lengths, positions


_PREFIXES = ("model.visual.", "visual.")

TowerT = TypeVar("TowerT", bound=QwenPatchTower)


def load_tower_weights(tower_cls: type[TowerT], model_dir, vision: dict, device: str | torch.device,
                       dtype: torch.dtype) -> TowerT:
    """tower_cls(vision) with the checkpoint's `model.visual.*` (or `visual.*`) weights, strictly, on
    `device` in `dtype` (a Qwen-VL tower: this folder's or Qwen3-VL's)."""
    from common.checkpoint import load_tensors

    state = {}
    for name, tensor in load_tensors(model_dir, _PREFIXES).items():
        prefix = next(p for p in _PREFIXES if name.startswith(p))
        state[name[len(prefix):]] = tensor
    with torch.device("meta"):
        tower = tower_cls(vision)
    tower = tower.to_empty(device="cpu")
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: vision tower weights do not match: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    tower = tower.to(device, dtype).eval()
    # Computed, not in the checkpoint, and kept in fp32 whatever the weights' dtype (as HF computes it).
    tower.inv_freq = tower_cls.rotary_inv_freq(vision).to(device)
    return tower


def load_qwen_tower(model_dir, vision: dict, device: torch.device, dtype: torch.dtype) -> QwenVisionTower:
    """The tower with the checkpoint's `visual.*` (or `model.visual.*`) weights, strictly."""
    tower = load_tower_weights(QwenVisionTower, model_dir, vision, device, dtype)
    if torch.device(device).type == "cuda":
        for block in tower.blocks:  # aligned GEMMs on the GPU (CPU keeps HF's exact products)
            block.mlp.fuse()
    return tower
