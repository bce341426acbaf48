"""Attention within spans of a flat token sequence: the vision towers' images, video frame groups and
Qwen2.5-VL's windows.

The patches of every image of a batch are one sequence [N, heads, head_dim]; a span [cu[i], cu[i+1])
attends only within itself. Two ways to run it, the same function:

- `flash`: one variable-length FlashAttention call over `cu_seqlens` (PyTorch's own FA2 build, the op
  behind `torch.nn.attention.varlen`), on CUDA in half precision. No gathers, no padding, one launch
  per layer whatever the mix of image sizes; any head dim that is a multiple of 8 (Qwen3-VL's 72).
  Where every span has one length (one image, a batch of one size) the spans are also a dense batch
  [spans, heads, length, head_dim] as they lie in memory: scaled_dot_product_attention's cuDNN kernel
  takes them without a copy and, on Hopper, runs faster than FA2 at head dims FA2 pads (72 runs as
  96). Which of the two runs is measured once per shape on the device (`_dense_is_faster`).
- `reference`: spans of equal length gathered into one scaled_dot_product_attention call per length
  (the same arithmetic per span as HF's call per image, so fp32 CPU outputs equal HF's exactly).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# (spans, length, heads, head_dim, dtype, device) -> whether the dense cuDNN call beat varlen FA2 there.
_DENSE_FASTER: dict[tuple, bool] = {}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: int, scale: float) -> torch.Tensor:
    """Attention of `spans` equal consecutive spans as one dense cuDNN batch: [N, heads, D] in and out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, heads, dim = q.shape
    q4, k4, v4 = (t.view(spans, n // spans, heads, dim).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)
    return out.transpose(1, 2).reshape(n, heads, dim)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
            scale: float) -> torch.Tensor:
    # aten's FA2 entry (what torch.nn.attention.varlen calls; the same positional signature in torch 2.4
    # through 2.13): dropout 0, not causal.
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                   0.0, False, False, scale=scale)[0]


def _dense_is_faster(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: AttentionSpans,
                     scale: float) -> bool:
    """Whether the dense cuDNN call beats varlen FA2 for this shape, timed once on these inputs (three
    runs each after a warm-up, CUDA events) and remembered; False when cuDNN cannot run it."""
    count = len(spans.cu_seqlens) - 1
    key = (count, spans.max_seqlen, q.shape[1], q.shape[2], q.dtype, q.device)
    if key not in _DENSE_FASTER:
        try:
            candidates = {
                True: lambda: _dense(q, k, v, count, scale),
                False: lambda: _varlen(q, k, v, spans.cu_seqlens, spans.max_seqlen, scale)}
            times = {}
            for dense, run in candidates.items():
                run()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    run()
                end.record()
                end.synchronize()
                times[dense] = start.elapsed_time(end)
            _DENSE_FASTER[key] = times[True] < times[False]
            log.info("vision attention over %d spans of %d: cuDNN %.3f ms, FA2 %.3f ms", count,
                     spans.max_seqlen, times[True] / 3, times[False] / 3)
        except Exception as exc:  # noqa: BLE001 - no cuDNN attention for this shape or build: FA2
            log.info("cuDNN attention unavailable for %s (%s); varlen FA2", key[:4], exc)
            _DENSE_FASTER[key] = False
    return _DENSE_FASTER[key]


@functools.cache
def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when the varlen FlashAttention op runs here and agrees with the reference on a probe (an
    old torch, a GPU without FA2, or a head dim it refuses falls back to the reference)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8:
        return False
    try:
        gen = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(96, 2, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
        spans = AttentionSpans.from_bounds([0, 32, 96], device, use_flash=True)
        got = spans.attend(q, k, v, head_dim**-0.5)
        reference = AttentionSpans.from_bounds([0, 32, 96], device, use_flash=False)
        want = reference.attend(q, k, v, head_dim**-0.5)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    except Exception as exc:  # noqa: BLE001 - no FA2 kernel for this GPU or build: the reference runs
        log.warning("varlen FlashAttention unavailable (%s); vision attention uses the SDPA reference", exc)
        return False
    if not err < 2e-2:
        log.warning("varlen FlashAttention disagrees with SDPA (relative error %.3g); using SDPA", err)
        return False
    return True


@dataclass(frozen=True)
class AttentionSpans:
    """Spans [cu[i], cu[i+1]) of a flat sequence that attend within themselves.

    cu_seqlens: int32 bounds on the device (flash); max_seqlen: the longest span; groups: for the
    reference path, per distinct span length a [spans, length] index of rows on the device."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    use_flash: bool
    groups: list[torch.Tensor] = field(default_factory=list)
    uniform: bool = False  # every span has length max_seqlen (> 0): a dense batch as it lies in memory

    @classmethod
    def from_bounds(cls, cu_seqlens: Sequence[int] | np.ndarray, device: torch.device,
                    use_flash: bool) -> AttentionSpans:
        """The spans of host bounds `cu_seqlens` (0, end of span 1, ..., N), copied to `device` once."""
        bounds = np.asarray(cu_seqlens, dtype=np.int64)
        lengths = np.diff(bounds)
        max_len = int(lengths.max()) if lengths.size else 0
        if use_flash:
            cu = torch.from_numpy(bounds.astype(np.int32)).to(device, non_blocking=True)
            return cls(cu, max_len, True, uniform=bool(lengths.size) and bool((lengths == max_len).all()))
        groups = []
        for length in np.unique(lengths[lengths > 0]):
            rows = bounds[:-1][lengths == length][:, None] + np.arange(length)[None, :]
            groups.append(torch.from_numpy(rows).to(device, non_blocking=True))
        return cls(torch.from_numpy(bounds), max_len, False, groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(q kᵀ * scale) v within each span; q, k, v [N, heads, head_dim] -> [N, heads, head_dim]."""
        if self.use_flash:
            if self.uniform and _dense_is_faster(q, k, v, self, scale):
                return _dense(q, k, v, len(self.cu_seqlens) - 1, scale)
            return _varlen(q, k, v, self.cu_seqlens, self.max_seqlen, scale)
        out = torch.empty_like(q)
        for rows in self.groups:  # [spans, L] -> [spans, heads, L, head_dim]
            qc, kc, vc = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qc, kc, vc, scale=scale).transpose(1, 2)
        return out
