"""The Gated DeltaNet layer's depthwise causal convolution over a step's packed prefill rows, SiLU and the
q, k heads' L2 norm in one launch; and the gather of conv windows (the K - 1 inputs before a position) that
a step writes into conv-state slots (decoder_svc/model/gated_deltanet_fla.py).

Where each input of the convolution comes from is a source code (int32, on the device):
  code >= 0:  row `code` of x, the step's projected rows [N, C];
  code == -1: zeros (before a fresh sequence's first token);
  code <= -2: a carried input, carried[(-code - 2) // (K - 1), :, (-code - 2) % (K - 1)] of the conv-state
              pool [S, C, K - 1] (columns oldest first).
So one launch serves rows of many sequences, each reading its carried inputs from its own slot, with no
gather, concatenation or column shuffle before it. Launch shapes depend on the row and channel counts only
(no host synchronisation, no data-dependent grid).

Per output row p, channel c, in fp32: y = silu(sum_j weight[c, j] * input(sources[p, j])[c]) over the K
taps j, oldest first, rounded to out's dtype; with normalize_channels > 0 each head of head_dim channels in
[0, normalize_channels) is then y / sqrt(sum(y^2) + eps) in fp32 from the rounded y (gated_deltanet_fla's
_l2norm), stored in out's dtype; channels from normalize_channels on (v) keep y.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32  # rows per program: each tap's weights loaded once for 32 rows
BLOCK_CHANNELS = 128  # channels per program (with the norm: whole heads, at least one)
MAX_TAPS = 8


@triton.jit
def _inputs(x_ptr, carried_ptr, codes, channels, mask, x_stride, carried_s, carried_c, carried_k,
            CARRY: tl.constexpr):
    """The inputs that `codes` name at `channels` (broadcastable to `mask`'s shape), in fp32."""
    codes = codes.to(tl.int64)
    from_x = codes >= 0
    row = tl.where(from_x, codes, 0)
    values = tl.load(x_ptr + row * x_stride + channels, mask=mask & from_x, other=0.0).to(tl.float32)
    if tl.min(codes) < -1:  # some rows read carried inputs (a chunk's first K - 1 rows): most tiles do not
        carried = -codes - 2  # >= 0 for carried inputs
        from_carried = carried >= 0
        carried = tl.where(from_carried, carried, 0)
        slot = carried // CARRY
        column = carried % CARRY
        cs = tl.load(carried_ptr + slot * carried_s + channels * carried_c + column * carried_k,
                     mask=mask & from_carried, other=0.0).to(tl.float32)
        values = tl.where(from_carried, cs, values)
    return values


@triton.jit
def _packed_causal_conv_kernel(x_ptr, sources_ptr, carried_ptr, weight_ptr, out_ptr, k_ptr, v_ptr,
                               rows, channels, normalize_channels, eps,
                               x_stride, carried_s, carried_c, carried_k, weight_c, weight_k, out_stride,
                               k_stride, v_stride,
                               TAPS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                               HEAD: tl.constexpr, NORMALIZE: tl.constexpr, SPLIT: tl.constexpr,
                               GROUPS: tl.constexpr):
    # SPLIT: out_ptr is q's output, k_ptr / v_ptr k's and v's; q and k each key head written to GROUPS
    # consecutive heads. Else out_ptr is [P, C] (k_ptr, v_ptr unused).
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = p < rows
    channel_ok = c < channels
    mask = row_ok[:, None] & channel_ok[None, :]
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(TAPS):
        codes = tl.load(sources_ptr + p * TAPS + j, mask=row_ok, other=-1)
        w = tl.load(weight_ptr + c * weight_c + j * weight_k, mask=channel_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * _inputs(x_ptr, carried_ptr, codes[:, None], c[None, :], mask, x_stride,
                                    carried_s, carried_c, carried_k, TAPS - 1)
    y = (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty)
    if NORMALIZE:  # the block holds whole heads: q and k heads normalised, v's left as they are
        yf = tl.reshape(y.to(tl.float32), (BLOCK_P, BLOCK_C // HEAD, HEAD))
        inv = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=2) + eps)  # [BLOCK_P, heads]
        scale = tl.reshape(tl.broadcast_to(inv[:, :, None], (BLOCK_P, BLOCK_C // HEAD, HEAD)),
                           (BLOCK_P, BLOCK_C))
        scale = tl.where((c < normalize_channels)[None, :], scale, 1.0)
        y = (y.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
    row = p[:, None].to(tl.int64)
    if SPLIT:
        # The block lies within one of q, k (normalize_channels / 2 channels each) and v (the rest), whole
        # heads: its first channel says which. Offsets are a scalar base plus aranges, so stores vectorise.
        first = tl.program_id(1) * BLOCK_C
        key = normalize_channels // 2
        in_q = first < key
        in_k = (first >= key) & (first < normalize_channels)
        in_v = first >= normalize_channels
        offset = tl.arange(0, BLOCK_C)[None, :] + (first - normalize_channels)
        tl.store(v_ptr + row * v_stride + offset, y, mask=mask & in_v)
        y3 = tl.reshape(y, (BLOCK_P, BLOCK_C // HEAD, HEAD))
        head = (tl.where(in_q, first, first - key) // HEAD + tl.arange(0, BLOCK_C // HEAD))[None, :, None]
        dim = tl.arange(0, HEAD)[None, None, :]
        row3 = row[:, :, None]
        rows_ok = row_ok[:, None, None]
        for r in tl.static_range(GROUPS):
            column = (head * GROUPS + r) * HEAD + dim
            tl.store(out_ptr + row3 * out_stride + column, y3, mask=rows_ok & in_q)
            tl.store(k_ptr + row3 * k_stride + column, y3, mask=rows_ok & in_k)
    else:
        tl.store(out_ptr + row * out_stride + c[None, :], y, mask=mask)


@triton.jit
def _gather_conv_windows_kernel(x_ptr, sources_ptr, carried_ptr, out_ptr, channels,
                                x_stride, carried_s, carried_c, carried_k, out_s, out_c, out_k,
                                CARRY: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    tap_ok = j < CARRY
    mask = (c < channels)[:, None] & tap_ok[None, :]
    codes = tl.load(sources_ptr + s * CARRY + j, mask=tap_ok, other=-1)
    window = _inputs(x_ptr, carried_ptr, codes[None, :], c[:, None], mask, x_stride,
                     carried_s, carried_c, carried_k, CARRY)
    tl.store(out_ptr + s * out_s + c[:, None] * out_c + j[None, :] * out_k,
             window.to(out_ptr.dtype.element_ty), mask=mask)


def supports(channels: int, taps: int, head_dim: int) -> bool:
    """Whether the kernels take these shapes: 2 to 8 taps, a power-of-two head dim from 16 to 256 (the
    norm's block; head_dim 0: no heads normalised)."""
    heads_ok = head_dim == 0 or (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)
    return channels > 0 and 2 <= taps <= MAX_TAPS and heads_ok


def _largest_power_of_two_dividing(n: int) -> int:
    return n & -n


def _check_sources(sources: torch.Tensor, rows: int, codes: int, name: str) -> None:
    if sources.dtype != torch.int32 or not sources.is_contiguous() or tuple(sources.shape) != (rows, codes):
        raise ValueError(f"{name} must be contiguous int32 [{rows}, {codes}] (got {sources.dtype} "
                         f"{tuple(sources.shape)})")


def _check_carried(carried: torch.Tensor, channels: int, taps: int) -> None:
    if carried.dim() != 3 or carried.shape[1:] != (channels, taps - 1):
        raise ValueError(f"carried {tuple(carried.shape)} does not hold [S, C, K - 1] = [S, {channels}, "
                         f"{taps - 1}] conv states")


def packed_causal_conv_(x: torch.Tensor, sources: torch.Tensor, carried: torch.Tensor, weight: torch.Tensor,
                        out: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
                        normalize_channels: int = 0, head_dim: int = 0, eps: float = 1e-6) -> None:
    """out [P, C] = silu(depthwise causal conv), row p's K inputs named by sources[p] (int32 [P, K],
    contiguous, taps oldest first) over x [N, C] and carried [S, C, K - 1] (any strides); weight [C, K]
    (any strides, any float dtype); x's and out's channel stride 1, any row stride. With
    normalize_channels > 0 (a multiple of head_dim) each head of head_dim channels below it is
    L2-normalised after the silu. Sums in fp32; out's dtype is the result's.

    Or out = (q, k, v), the channels split where a Gated DeltaNet layer's are (q, k: normalize_channels / 2
    each, normalised; v: the rest), each a tensor of its own: q, k [P, H * G, head_dim], v [P, Hv, Dv]
    (heads side by side in a row, any row stride), where H = normalize_channels / 2 / head_dim; each key
    head is written to G consecutive heads (G = 1: as they are; G = Hv / H: one per value head, as fla's
    chunked rule takes them)."""
    split = isinstance(out, tuple)
    q_out, k_out, v_out = out if split else (out, out, out)
    rows = q_out.shape[0]
    channels = x.shape[1]
    taps = weight.shape[1]
    if not supports(channels, taps, head_dim if normalize_channels else 0):
        raise ValueError(f"{channels} channels, {taps} taps, head dim {head_dim}: unsupported")
    if normalize_channels and (normalize_channels % head_dim or normalize_channels > channels):
        raise ValueError(f"normalize_channels {normalize_channels}: a multiple of head_dim {head_dim} "
                         f"up to {channels}")
    groups = 1
    if split:
        groups = _check_split(q_out, k_out, v_out, rows, channels, normalize_channels, head_dim)
    elif out.shape[1] != channels or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} needs {channels} channels at stride 1")
    if weight.shape[0] != channels or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: channel counts differ, or x's "
                         "channel stride is not 1")
    if rows == 0:
        return
    _check_sources(sources, rows, taps, "sources")
    _check_carried(carried, channels, taps)
    block_c = min(BLOCK_CHANNELS, triton.next_power_of_2(channels))
    if normalize_channels:  # whole heads per block; a block never straddles the q-k (split) or k-v boundary
        block_c = head_dim * max(1, min(BLOCK_CHANNELS // head_dim, _largest_power_of_two_dividing(
            normalize_channels // head_dim // (2 if split else 1))))
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(channels, block_c))
    _packed_causal_conv_kernel[grid](
        x, sources, carried, weight, q_out, k_out, v_out, rows, channels, normalize_channels, eps,
        x.stride(0), *carried.stride(), *weight.stride(), q_out.stride(0), k_out.stride(0), v_out.stride(0),
        TAPS=taps, BLOCK_P=BLOCK_ROWS, BLOCK_C=block_c, HEAD=head_dim if normalize_channels else block_c,
        NORMALIZE=normalize_channels > 0, SPLIT=split, GROUPS=groups,
        num_warps=4 if BLOCK_ROWS * block_c <= 4096 else 8)


def _check_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, channels: int,
                 normalize_channels: int, head_dim: int) -> int:
    """The heads each key head is written to (G) of split outputs, after checking their shapes."""
    if not normalize_channels:
        raise ValueError("split outputs need normalize_channels (the q and k channels) and head_dim")
    key_heads = normalize_channels // 2 // head_dim
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != rows or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name} {tuple(t.shape)} (strides {t.stride()}) must be [{rows}, heads, dim] "
                             "with its heads side by side in a row")
    if (normalize_channels % (2 * head_dim) or q.shape != k.shape or q.shape[2] != head_dim
            or q.shape[1] % key_heads):
        raise ValueError(f"q, k {tuple(q.shape)}, {tuple(k.shape)}: [P, {key_heads} * G, {head_dim}] "
                         "expected")
    if v.shape[1] * v.shape[2] != channels - normalize_channels:
        raise ValueError(f"v {tuple(v.shape)} does not hold the {channels - normalize_channels} value "
                         "channels")
    return q.shape[1] // key_heads


def gather_conv_windows_(x: torch.Tensor, sources: torch.Tensor, carried: torch.Tensor,
                         out: torch.Tensor) -> None:
    """out[s, c, j] = the input sources[s, j] names at channel c (out [S, C, K - 1] in carried's dtype;
    sources int32 [S, K - 1], contiguous; x, carried as packed_causal_conv_ takes them): conv states to
    write into slots. out must not overlap carried (the caller copies it into the pool afterwards)."""
    windows, channels, carry = out.shape
    if windows == 0:
        return
    if not supports(channels, carry + 1, 0):
        raise ValueError(f"{channels} channels, {carry + 1} taps: unsupported")
    if x.shape[1] != channels or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} needs {channels} channels at stride 1")
    _check_sources(sources, windows, carry, "sources")
    _check_carried(carried, channels, carry + 1)
    block_c = min(BLOCK_CHANNELS, triton.next_power_of_2(channels))
    _gather_conv_windows_kernel[(windows, triton.cdiv(channels, block_c))](
        x, sources, carried, out, channels, x.stride(0), *carried.stride(), *out.stride(),
        CARRY=carry, BLOCK_K=triton.next_power_of_2(carry), BLOCK_C=block_c, num_warps=4)
