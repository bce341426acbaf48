"""Attention within spans of a flat token sequence: the vision towers' images, video frame groups and
Qwen2.5-VL's windows.

The patches of every image of a batch are one sequence [N, heads, head_dim]; a span [cu[i], cu[i+1])
attends only within itself. Two ways to run it, the same function:

- `flash`: on CUDA in half precision, one launch per layer whatever the mix of image sizes, no gathers,
  no padding. Which kernel runs is `MMSERVE_VISION_ATTENTION` (read when a plan's spans are made):
  - `sdpa` (default): one variable-length FlashAttention call over `cu_seqlens` (PyTorch's own FA2
    build, the op behind `torch.nn.attention.varlen`); any head dim that is a multiple of 8 (Qwen3-VL's
    72). Where every span has one length (one image, a batch of one size) the spans are also a dense
    batch [spans, heads, length, head_dim] as they lie in memory: scaled_dot_product_attention's cuDNN
    kernel takes them without a copy and, on Hopper, runs faster than FA2 at head dims FA2 pads (72
    runs as 96). Which of the two runs is measured once per shape on the device (`_dense_is_faster`).
  - `triton`: the Triton flash kernel of common/kernels/vision_attention.py (head dim padded to a
    multiple of 16 inside the kernel: 72 runs as 80), its query blocks mapped on the host per plan.
  - `auto`: the Triton kernel or the `sdpa` choice, whichever is faster, measured once per shape on the
    device (`_triton_is_faster`; the Triton output checked against the other first).
- `reference`: spans of equal length gathered into one scaled_dot_product_attention call per length
  (the same arithmetic per span as HF's call per image, so fp32 CPU outputs equal HF's exactly).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTENTION_ENV = "MMSERVE_VISION_ATTENTION"
ATTENTION_KERNELS = ("sdpa", "triton", "auto")

# (spans, length, heads, head_dim, dtype, device) -> whether the dense cuDNN call beat varlen FA2 there.
_DENSE_FASTER: dict[tuple, bool] = {}
# (spans, length, heads, head_dim, dtype, device, uniform) -> whether the Triton kernel beat the sdpa choice.
_TRITON_FASTER: dict[tuple, bool] = {}
# use_fixed_choices(): kernels chosen by shape alone, never by a timing
_FIXED = {"on": False}
# With fixed choices, uniform spans at least this long take the dense cuDNN call (where it beat FA2 on the
# H100: 4096- and 4900-patch images; FA2 won at 64 and 256).
FIXED_DENSE_FROM = 1024


def use_fixed_choices(on: bool = True) -> None:
    """Choose the attention kernel by the spans' shape alone (a fixed rule) instead of timing the
    candidates on first sight, and never the Triton kernel under MMSERVE_VISION_ATTENTION=auto: two
    processes (or two runs) then compute the same image with the same kernels. The encoder's
    --deterministic mode sets it; the timed choice can differ between processes as the timings do."""
    _FIXED["on"] = on
    _DENSE_FASTER.clear()


def attention_kernel() -> str:
    """The flash path's kernel named by MMSERVE_VISION_ATTENTION: sdpa (default), triton or auto."""
    value = os.environ.get(ATTENTION_ENV, "").strip().lower() or "sdpa"
    if value not in ATTENTION_KERNELS:
        raise ValueError(f"{ATTENTION_ENV}={value!r}: expected one of {', '.join(ATTENTION_KERNELS)}")
    return value


@functools.cache
def _triton_module():
    """common.kernels.vision_attention, or None where Triton cannot be imported."""
    try:
        from common.kernels import vision_attention
    except ImportError as exc:
        log.warning("the Triton vision attention kernel is unavailable (%s); %s=sdpa", exc, ATTENTION_ENV)
        return None
    return vision_attention


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


def _time_ms(run) -> float:
    """Milliseconds per run() on the current CUDA stream: one warm-up, then three runs between events."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 3


def _dense_is_faster(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: AttentionSpans,
                     scale: float) -> bool:
    """Whether the dense cuDNN call beats varlen FA2 for this shape, timed once on these inputs (three
    runs each after a warm-up, CUDA events) and remembered; False when cuDNN cannot run it."""
    count = len(spans.cu_seqlens) - 1
    key = (count, spans.max_seqlen, q.shape[1], q.shape[2], q.dtype, q.device)
    if key not in _DENSE_FASTER and _FIXED["on"]:
        try:  # once, untimed: whether cuDNN runs this shape at all
            _dense(q, k, v, count, scale)
            _DENSE_FASTER[key] = spans.max_seqlen >= FIXED_DENSE_FROM
        except Exception as exc:  # noqa: BLE001 - no cuDNN attention for this shape or build: FA2
            log.info("cuDNN attention unavailable for %s (%s); varlen FA2", key[:4], exc)
            _DENSE_FASTER[key] = False
    if key not in _DENSE_FASTER:
        try:
            dense = _time_ms(lambda: _dense(q, k, v, count, scale))
            varlen = _time_ms(lambda: _varlen(q, k, v, spans.cu_seqlens, spans.max_seqlen, scale))
            _DENSE_FASTER[key] = dense < varlen
            log.info("vision attention over %d spans of %d: cuDNN %.3f ms, FA2 %.3f ms", count,
                     spans.max_seqlen, dense, varlen)
        except Exception as exc:  # noqa: BLE001 - no cuDNN attention for this shape or build: FA2
            log.info("cuDNN attention unavailable for %s (%s); varlen FA2", key[:4], exc)
            _DENSE_FASTER[key] = False
    return _DENSE_FASTER[key]


def _triton_is_faster(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: AttentionSpans,
                      scale: float) -> bool:
    """Whether the Triton kernel beats the sdpa choice (cuDNN or FA2) for this shape and agrees with it,
    timed once on these inputs and remembered; False when it cannot run or disagrees."""
    count = len(spans.cu_seqlens) - 1
    key = (count, spans.max_seqlen, q.shape[1], q.shape[2], q.dtype, q.device, spans.uniform)
    if key not in _TRITON_FASTER:
        try:
            want = spans._sdpa(q, k, v, scale).float()
            err = ((spans._triton(q, k, v, scale).float() - want).norm() / want.norm()).item()
            if not err < 2e-2:
                raise ValueError(f"relative error {err:.3g} against the sdpa choice")
            triton_ms = _time_ms(lambda: spans._triton(q, k, v, scale))
            sdpa_ms = _time_ms(lambda: spans._sdpa(q, k, v, scale))
            _TRITON_FASTER[key] = triton_ms < sdpa_ms
            log.info("vision attention over %d spans of %d (head dim %d): Triton %.3f ms, sdpa %.3f ms",
                     key[0], spans.max_seqlen, q.shape[2], triton_ms, sdpa_ms)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails or disagrees is not chosen
            log.warning("Triton vision attention not used for %s: %s", key[:4], exc)
            _TRITON_FASTER[key] = False
    return _TRITON_FASTER[key]


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when the flash path (with MMSERVE_VISION_ATTENTION's kernel) runs here and agrees with the
    reference on a probe (an old torch, a GPU without FA2, or a head dim it refuses falls back to the
    reference)."""
    return _flash_probe(device, dtype, head_dim, attention_kernel())


@functools.cache
def _flash_probe(device: torch.device, dtype: torch.dtype, head_dim: int, kernel: str) -> bool:
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
        log.warning("vision flash attention (%s) unavailable (%s); the SDPA reference runs", kernel, exc)
        return False
    if not err < 2e-2:
        log.warning("vision flash attention (%s) disagrees with SDPA (relative error %.3g); using SDPA",
                    kernel, err)
        return False
    return True


@dataclass(frozen=True)
class AttentionSpans:
    """Spans [cu[i], cu[i+1]) of a flat sequence that attend within themselves.

    cu_seqlens: int32 bounds on the device (flash); max_seqlen: the longest span; groups: for the
    reference path, per distinct span length a [spans, length] index of rows on the device; kernel: the
    flash path's (sdpa, triton or auto; see the module's docstring); block_map: the Triton kernel's
    query blocks on the device (kernel triton or auto)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    use_flash: bool
    groups: list[torch.Tensor] = field(default_factory=list)
    uniform: bool = False  # every span has length max_seqlen (> 0): a dense batch as it lies in memory
    kernel: str = "sdpa"
    block_map: torch.Tensor | None = None

    @classmethod
    def from_bounds(cls, cu_seqlens: Sequence[int] | np.ndarray, device: torch.device,
                    use_flash: bool, kernel: str | None = None) -> AttentionSpans:
        """The spans of host bounds `cu_seqlens` (0, end of span 1, ..., N), copied to `device` once.
        kernel: the flash path's; None: MMSERVE_VISION_ATTENTION's (`attention_kernel`)."""
        bounds = np.asarray(cu_seqlens, dtype=np.int64)
        lengths = np.diff(bounds)
        max_len = int(lengths.max()) if lengths.size else 0
        if use_flash:
            kernel = kernel or attention_kernel()
            cu = torch.from_numpy(bounds.astype(np.int32)).to(device, non_blocking=True)
            uniform = bool(lengths.size) and bool((lengths == max_len).all())
            triton_kernel = _triton_module() if kernel != "sdpa" else None
            if triton_kernel is None:
                return cls(cu, max_len, True, uniform=uniform)
            blocks = triton_kernel.make_block_map(bounds, triton_kernel.block_m_for(max_len))
            block_map = torch.from_numpy(blocks).to(device, non_blocking=True)
            return cls(cu, max_len, True, uniform=uniform, kernel=kernel, block_map=block_map)
        groups = []
        for length in np.unique(lengths[lengths > 0]):
            rows = bounds[:-1][lengths == length][:, None] + np.arange(length)[None, :]
            groups.append(torch.from_numpy(rows).to(device, non_blocking=True))
        return cls(torch.from_numpy(bounds), max_len, False, groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(q kᵀ * scale) v within each span; q, k, v [N, heads, head_dim] -> [N, heads, head_dim]."""
        if self.use_flash:
            timed = self.kernel == "auto" and not _FIXED["on"]
            if self.kernel == "triton" or (timed and _triton_is_faster(q, k, v, self, scale)):
                return self._triton(q, k, v, scale)
            return self._sdpa(q, k, v, scale)
        out = torch.empty_like(q)
        for rows in self.groups:  # [spans, L] -> [spans, heads, L, head_dim]
            qc, kc, vc = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qc, kc, vc, scale=scale).transpose(1, 2)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The sdpa kernel: dense cuDNN where the spans are uniform and it is faster there, else FA2."""
        if self.uniform and _dense_is_faster(q, k, v, self, scale):
            return _dense(q, k, v, len(self.cu_seqlens) - 1, scale)
        return _varlen(q, k, v, self.cu_seqlens, self.max_seqlen, scale)

    def _triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The Triton kernel over the spans' query blocks (made with the spans)."""
        return _triton_module().varlen_attention(q, k, v, self.cu_seqlens, self.max_seqlen, scale,
                                                 block_map=self.block_map)
