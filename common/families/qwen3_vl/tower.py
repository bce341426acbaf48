"""Qwen3-VL's vision transformer with its DeepStack outputs, several images of any size in one forward.

The patches of every image are concatenated into one sequence (the processor's order: each 2x2 merge
block contiguous); attention stays inside each image. The math follows Hugging Face's
`Qwen3VLVisionModel` step by step: the patch embedding (a Conv3d whose stride is its kernel, with a
bias), a learned 2D position table bilinearly resampled to each image's grid (align_corners=True), 2D
rotary in fp32, LayerNorm, a tanh-GELU MLP, the patch merger (LayerNorm, then 2x2 blocks through a GELU
MLP) and, after the blocks named by `deepstack_visual_indexes`, one DeepStack merger each (the 2x2
block concatenated first, then its LayerNorm). In fp32 on a CPU every output equals
`get_image_features` (its pooler_output and each of its deepstack_features) exactly.

Attention is batched as in Qwen2.5-VL's tower: images of equal patch count go through one
scaled_dot_product_attention call together, the same arithmetic per image as HF's call per image.

The elementwise steps go through `Qwen3VisionOps` (eager: HF's exact operations). On a GPU the encoder
switches to `Qwen3VisionOps.compiled()` (`use_ops`), as Qwen2.5-VL's tower does: the 2D rotary, the
LayerNorms and the residual add before each block's second LayerNorm fused by torch.compile (dynamic
shapes), bf16 results within rounding of the eager ones. The tanh GELU is one native kernel already.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.families.qwen2_5_vl.tower import (
    QwenPatchTower,
    VisionAttention,
    VisionOps,
    load_tower_weights,
    rotary,
)
from common.vision.attention import AttentionSpans, flash_supported

Grid = tuple[int, int, int]

_LN_EPS = 1e-6  # every LayerNorm of HF's Qwen3-VL vision model


@dataclass(frozen=True)
class Qwen3VisionFeatures:
    """One forward's outputs: `merged` [rows, out_hidden] and one [rows, out_hidden] per DeepStack level
    (in `deepstack_visual_indexes` order); rows are every image's merged tokens, in image order."""

    merged: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]

    @property
    def parts(self) -> int:
        """1 (the merged features) + the number of DeepStack levels."""
        return 1 + len(self.deepstack)

    def stacked(self) -> torch.Tensor:
        """[parts, rows, out_hidden]: the merged features first, then each DeepStack level (the layout of
        the multi-part embedding handoff)."""
        return torch.stack((self.merged, *self.deepstack))

    def split(self, rows: Sequence[int]) -> list[torch.Tensor]:
        """The stacked tensor cut per image: [parts, rows_i, out_hidden] for each count in `rows`."""
        return list(self.stacked().split(list(rows), dim=1))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """nn.LayerNorm's forward over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its LayerNorm): a residual add and the next pre-norm (one pass when compiled)."""
    x = x + delta
    return x, F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear_gelu_tanh(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """gelu_tanh(linear(x)) as HF computes it: the product rounded, then the activation."""
    return F.gelu(linear(x), approximate="tanh")


def linear_gelu_tanh_epilogue(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """The same in one cuBLASLt call on a GPU, the tanh GELU applied to the fp32 accumulator (its epilogue)
    rather than to the rounded product. Elsewhere, for a layer that is not a plain nn.Linear (an FP8 one)
    or an input that is not a matrix: linear_gelu_tanh (torch's CPU form of the call applies the erf GELU,
    not the tanh one)."""
    if x.device.type != "cuda" or type(linear) is not nn.Linear or x.dim() != 2:
        return linear_gelu_tanh(x, linear)
    return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)


class Qwen3VisionOps(VisionOps):
    """Qwen3-VL's elementwise steps: the rotary (VisionOps', used by VisionAttention), the LayerNorms and
    the residual add + LayerNorm of each block. Eager by default (HF's operations, bit-equal in fp32);
    `compiled()` fuses each with torch.compile (GPU)."""

    layer_norm = staticmethod(layer_norm)
    add_layer_norm = staticmethod(add_layer_norm)
    linear_gelu_tanh = staticmethod(linear_gelu_tanh)

    @classmethod
    def compiled(cls) -> type[Qwen3VisionOps]:
        """A Qwen3VisionOps whose steps are torch.compile'd (dynamic shapes: one compile for any batch)."""
        return type("CompiledQwen3VisionOps", (cls,), {
            "rotary": staticmethod(torch.compile(rotary, dynamic=True)),
            "layer_norm": staticmethod(torch.compile(layer_norm, dynamic=True)),
            "add_layer_norm": staticmethod(torch.compile(add_layer_norm, dynamic=True))})

    @classmethod
    def fused(cls) -> type[Qwen3VisionOps]:
        """A Qwen3VisionOps whose rotary with the q/k/v split, and residual add + LayerNorm, run as one
        Triton kernel each (fused_ops), and the MLP's tanh GELU in its first product's epilogue; the first
        LayerNorm is one native kernel."""
        from common.kernels import vision_fused_ops as fused_ops

        return type("FusedQwen3VisionOps", (cls,), {
            "rotary_qkv": staticmethod(fused_ops.rotary_qkv),
            "add_layer_norm": staticmethod(fused_ops.add_layer_norm),
            "linear_gelu_tanh": staticmethod(linear_gelu_tanh_epilogue)})


class VisionMLP(nn.Module):
    """linear_fc2(gelu_tanh(linear_fc1(x))), with biases (HF's Qwen3VLVisionMLP)."""

    ops: type[Qwen3VisionOps] = Qwen3VisionOps  # the tower's (use_ops): the GELU in fc1's epilogue on GPU

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.ops.linear_gelu_tanh(x, self.linear_fc1))


class VisionBlock(nn.Module):
    """Pre-LayerNorm attention (2D rotary, within each image) and MLP, with residuals."""

    ops: type[Qwen3VisionOps] = Qwen3VisionOps

    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.attn = VisionAttention(dim, num_heads)  # qkv, proj: the same weights and math as Qwen2.5-VL's
        self.mlp = VisionMLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: AttentionSpans
                ) -> torch.Tensor:
        n1, n2 = self.norm1, self.norm2
        h = self.ops.layer_norm(x, n1.weight, n1.bias, n1.eps)
        x, h = self.ops.add_layer_norm(x, self.attn(h, cos, sin, spans), n2.weight, n2.bias, n2.eps)
        return x + self.mlp(h)


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (consecutive rows) through a two-layer GELU MLP. The final merger
    normalises each patch first; a DeepStack merger (`postshuffle`) normalises the concatenated block."""

    def __init__(self, out_dim: int, dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else dim, eps=_LN_EPS)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def block_order_positions(grid: Grid, merge: int) -> np.ndarray:
    """(row, column) [t*h*w, 2] of each patch of one image in the processor's order (2x2 merge blocks
    contiguous, row-major within and across blocks), repeated for each of the t frames."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hw = np.stack([rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
                   cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)], axis=1)
    return np.tile(hw, (t, 1))


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights along one axis, align_corners
    =True, with the fp32 operations of transformers' _interpolation_axis_taps_weights (5.24): the source
    coordinate is index * (side - 1) / (size - 1), each weight 1 - |distance|, so the sums are bit-equal.
    Earlier releases (fast_pos_embed_interpolate) took the coordinates from torch.linspace, added the four
    taps one by one and cast the weights to the table's dtype first: the same interpolation, rounded
    differently (last bits in fp32; the weights' bf16 rounding in bf16)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(positions: np.ndarray, sizes: np.ndarray, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [N, 4] into the flattened side x side position table and their weights [N, 4] that
    resample it bilinearly to each patch's image grid. positions: (row, column) per patch; sizes: that
    patch's image (h, w)."""
    pos, size = torch.from_numpy(positions), torch.from_numpy(sizes)
    h_taps, h_weights = _axis_taps(pos[:, 0], size[:, 0], side)
    w_taps, w_weights = _axis_taps(pos[:, 1], size[:, 1], side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


@functools.lru_cache(maxsize=512)
def grid_taps(merge: int, side: int, t: int, h: int, w: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """One image's (or video's) part of a batch plan: its patches' (row, column) [t*h*w, 2], and the
    position table's bilinear taps and weights for them (`position_taps`)."""
    positions = block_order_positions((t, h, w), merge).astype(np.int64)
    sizes = np.tile(np.array([[h, w]], dtype=np.int64), (len(positions), 1))
    indices, weights = position_taps(positions, sizes, side)
    positions.flags.writeable = False  # shared by every batch with this grid
    return positions, indices, weights


class Qwen3VisionTower(QwenPatchTower):
    """Pixel patches of several images (as Qwen2VLImageProcessor lays them out) to merged embeddings and
    DeepStack features. Parameter names are HF's under `model.visual.`, so checkpoints load strictly."""

    # Patch embedding as one matrix product (True), as the Conv3d (False), or by device (None: the
    # product on a GPU, where cuDNN's 3D convolutions are slow; the Conv3d on a CPU, whose kernel sums in
    # another order than a matrix product, about 1e-6 apart in fp32, and HF uses the Conv3d).
    patch_as_linear: bool | None = None
    # Varlen FlashAttention where it runs (CUDA, half precision); False: the SDPA reference everywhere.
    flash_attention = True

    def __init__(self, vision: dict) -> None:
        super().__init__(vision, default_patch=16, patch_bias=True)
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {act!r} is not supported; only gelu_pytorch_tanh")
        depth = int(vision.get("depth", vision.get("num_hidden_layers")))
        self.deepstack_indexes = [int(i) for i in vision.get("deepstack_visual_indexes", ())]
        if any(not 0 <= i < depth for i in self.deepstack_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_indexes} outside 0..{depth - 1}")
        num_positions = int(vision.get("num_position_embeddings", 2304))
        self.side = int(num_positions**0.5)  # HF: int(num_position_embeddings ** 0.5), a square table
        out_dim = int(vision["out_hidden_size"])
        self.pos_embed = nn.Embedding(num_positions, self.dim)
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.num_heads, int(vision["intermediate_size"]))
                                    for _ in range(depth))
        self.merger = PatchMerger(out_dim, self.dim, self.merge, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(out_dim, self.dim, self.merge, postshuffle=True) for _ in self.deepstack_indexes)

    @property
    def parts(self) -> int:
        """Tensors per image: the merged features and one per DeepStack level."""
        return 1 + len(self.deepstack_indexes)

    def num_rows(self, grid: Sequence[int]) -> int:
        """Merged rows (= image tokens) of an image of this grid."""
        t, h, w = (int(x) for x in grid)
        return t * h * w // (self.merge * self.merge)

    def layout(self, grids: Sequence[Grid]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Host-side plan of a batch: (row, column) of every patch, its image's (h, w), and the image
        bounds in patches (cu_seqlens; each frame of a video is its own chunk, as in HF)."""
        positions, sizes, cu = [], [], [0]
        for t, h, w in grids:
            if h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)} is not a multiple of the {self.merge}x{self.merge} merge")
            positions.append(block_order_positions((t, h, w), self.merge))
            sizes.append(np.tile(np.array([[h, w]], dtype=np.int64), (t * h * w, 1)))
            for _ in range(t):
                cu.append(cu[-1] + h * w)
        return np.concatenate(positions).astype(np.int64), np.concatenate(sizes), cu

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, patch_dim] pixel rows to [N, dim] (the Conv3d, or its matrix product: `patch_as_linear`)."""
        proj = self.patch_embed.proj
        linear = self.patch_as_linear
        if linear is None:
            linear = pixel_values.device.type != "cpu"
        pixels = pixel_values.to(proj.weight.dtype)
        if linear:
            return F.linear(pixels, proj.weight.view(self.dim, -1), proj.bias)
        return proj(pixels.view(-1, self.channels, self.temporal, self.patch, self.patch)).view(-1, self.dim)

    def plan(self, grids: Sequence[Grid], device: torch.device, dtype: torch.dtype) -> Qwen3TowerPlan:
        """Everything a forward over these grids needs besides the pixels, on `device` (activations of
        `dtype`): the resampled position embeddings, the rotary tables and the image spans."""
        for t, h, w in grids:
            if h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)} is not a multiple of the {self.merge}x{self.merge} merge")
        parts = [grid_taps(self.merge, self.side, *grid) for grid in grids]  # cached per grid
        positions = np.concatenate([part[0] for part in parts])
        cu = np.concatenate([[0], np.cumsum([h * w for t, h, w in grids for _ in range(t)])])
        indices = torch.cat([part[1] for part in parts]).to(device, non_blocking=True)
        weights = torch.cat([part[2] for part in parts]).to(device, non_blocking=True)
        # HF gathers the 4 taps, weights them and sums over the taps (the weights cast to the table's dtype
        # by the product); the same expression keeps the same rounding.
        pos = (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(dtype)
        freqs = torch.from_numpy(positions).to(device, non_blocking=True)[..., None].float() * self.inv_freq
        emb = freqs.reshape(len(positions), -1)  # cat(row frequencies, column frequencies)
        emb = torch.cat((emb, emb), dim=-1)
        flash = self.flash_attention and flash_supported(device, dtype, self.dim // self.num_heads)
        return Qwen3TowerPlan(pos, emb.cos(), emb.sin(), AttentionSpans.from_bounds(cu, device, flash))

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> Qwen3VisionFeatures:
        """The features of pixel_values [sum of t*h*w, patch_dim]: merged [sum of t*h*w/4, out_hidden] and
        one tensor of that shape per DeepStack level."""
        dtype = self.patch_embed.proj.weight.dtype
        return self.run(pixel_values, self.plan(grids, pixel_values.device, dtype))

    def run(self, pixel_values: torch.Tensor, plan: Qwen3TowerPlan) -> Qwen3VisionFeatures:
        """forward() with its plan made: device work only (what a CUDA graph captures)."""
        x = self.embed_patches(pixel_values) + plan.pos
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.spans)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return Qwen3VisionFeatures(self.merger(x), tuple(deepstack))


@dataclass(frozen=True)
class Qwen3TowerPlan:
    """A batch's layout on the device (Qwen3VisionTower.plan): the position embeddings resampled to each
    patch, cos/sin of the 2D rotary per patch, and the image (frame group) spans."""

    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    spans: AttentionSpans



def load_qwen3_tower(model_dir, vision: dict, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> Qwen3VisionTower:
    """The tower with the checkpoint's `model.visual.*` (or `visual.*`) weights, strictly."""
    return load_tower_weights(Qwen3VisionTower, model_dir, vision, device, dtype)
