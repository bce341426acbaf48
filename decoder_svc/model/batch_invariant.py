"""The decoder's deterministic mode: every product and every attention row computed the same way whatever
else shares the step (`--deterministic`).

Two things change with a batch and move a greedy answer by an ulp, then a token:
- Matrix products. cuBLAS (and on CPU, MKL's one-row and few-row paths) choose their kernels, tiles and
  splits of K by the shape, so a row sums in another order at 1, 8 or 300 rows. `BatchInvariantMatmuls`
  (a torch dispatch mode the model enters around its forward) sends every `mm`/`addmm` to one kernel per
  weight shape: on CUDA common/kernels/invariant_matmul.py, on CPU MKL's many-row path with the rows
  padded to a multiple of `CPU_ROW_MULTIPLE` (the few-row paths sum in other orders).
- Attention. A prompt in one chunk or two, a decode row alone or among others, a split of the keys over
  programs: each sums a row's keys in another grouping. `TiledTorchAttentionBackend` (CPU) and the Triton
  backend in its invariant setting (kernel_dispatch.InvariantTritonAttentionBackend) walk each row's keys in
  tiles of fixed absolute positions, in order, one program per row block of a fixed size, never split:
  tiles past a row's last visible key add exact zeros, so a row's sum is the same for any chunking.
The norms, activations, rotary and sampling are per row already (seeded sampling draws from the request's
own generator). A hybrid stack's Gated DeltaNet layers see the mode (`invariant_matmuls_active`) and run
every token alone through the recurrent form from its sequence's state (model/gated_deltanet.py).
What stays outside: tensor parallelism (the all-reduce's order follows the message size)
and FP8 projections (their kernels are chosen by rows); the engine refuses both with the mode.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from decoder_svc.model.attention import TorchAttentionBackend

aten = torch.ops.aten

CPU_ROW_MULTIPLE = 16  # MKL sums a row the same way at every row count from 12 up; pad to a multiple of 16
KEY_TILE = 32  # keys per tile of the CPU attention (absolute positions 0-31, 32-63, ...)


def invariant_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias broadcast to [M, N]), row i independent of M and of the other rows."""
    if a.is_cuda:
        from common.kernels.invariant_matmul import invariant_matmul

        if bias is not None and bias.dim() == 1:
            return invariant_matmul(a, b, bias)
        out = invariant_matmul(a, b)
        return out if bias is None else out + bias
    rows = a.shape[0]
    pad = -rows % CPU_ROW_MULTIPLE
    if pad:
        a = torch.cat((a, a.new_zeros(pad, a.shape[1])))
    out = torch.mm(a, b)[:rows]
    return out if bias is None else out + bias


class BatchInvariantMatmuls(TorchDispatchMode):
    """Inside the block, every product of rows by a matrix (`linear`, `matmul` by a matrix, `mm`, `addmm`:
    what nn.Linear and `@` come to, with or without inference_mode) runs invariant_mm. Scoped to the thread
    that enters it; other ops (the attention's batched products among them) pass through unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.linear.default:  # what nn.Linear reaches under inference_mode (not decomposed)
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = invariant_mm(x.reshape(-1, x.shape[-1]), weight.t(), bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        if func is aten.matmul.default and args[0].dim() >= 2 and args[1].dim() == 2:
            x, other = args
            return invariant_mm(x.reshape(-1, x.shape[-1]), other).view(*x.shape[:-1], other.shape[1])
        if func is aten.mm.default:
            return invariant_mm(args[0], args[1])
        if func is aten.addmm.default and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            return invariant_mm(args[1], args[2], args[0])
        return func(*args, **kwargs)


def invariant_matmuls_active() -> bool:
    """True inside a BatchInvariantMatmuls block on this thread."""
    return any(isinstance(mode, BatchInvariantMatmuls) for mode in _get_current_dispatch_mode_stack())


class TiledTorchAttentionBackend(TorchAttentionBackend):
    """The torch reference attention (any device), each sequence's rows over key tiles of fixed absolute
    positions with an online softmax, the rows padded to a multiple of CPU_ROW_MULTIPLE: a row's result does
    not depend on its chunk, on the other sequences, nor on whether it decodes (module docstring)."""

    batch_decodes = False  # a decode row takes the same path as a prompt's rows

    def _one_sequence(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int, block_size: int, scale: float, window: int | None = None,
                      key_limits: torch.Tensor | None = None) -> torch.Tensor:
        keys, values = self._gather(kv_cache, block_table[:-(-seq_len // block_size)].long())
        return tiled_attention(q, keys[:seq_len], values[:seq_len], scale, window, key_limits)


def tiled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    window: int | None = None, key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last n positions q [n, H, D] over keys, values [S, Hk, D] (positions 0..S-1),
    in fp32, KEY_TILE keys at a time; row j (position S - n + j) sees keys up to its position (or up to
    key_limits[j]) and, with a window, above position - window. Returns [n, H, D] in q's dtype."""
    n, heads, dim = q.shape
    seq_len = keys.shape[0]
    groups = heads // keys.shape[1]
    rows = n + (-n % CPU_ROW_MULTIPLE)
    padded_keys = seq_len + (-seq_len % KEY_TILE)
    qh = q.new_zeros(rows, heads, dim, dtype=torch.float32)
    qh[:n] = q
    qh = qh.transpose(0, 1)  # [H, rows, D]
    kp = keys.new_zeros(padded_keys, heads, dim, dtype=torch.float32)
    vp = torch.zeros_like(kp)
    kp[:seq_len] = keys.repeat_interleave(groups, dim=1) if groups > 1 else keys
    vp[:seq_len] = values.repeat_interleave(groups, dim=1) if groups > 1 else values
    position = torch.arange(seq_len - n, seq_len - n + rows, device=q.device)
    last = position.clone()
    if key_limits is not None:
        last[:n] = key_limits.to(q.device)
    last = last.clamp(max=seq_len - 1)  # padded rows see what the last row may: no row sees nothing
    m = torch.full((heads, rows), float("-inf"), device=q.device)
    total = torch.zeros(heads, rows, device=q.device)
    acc = torch.zeros(heads, rows, dim, device=q.device)
    for lo in range(0, padded_keys, KEY_TILE):
        key_pos = torch.arange(lo, lo + KEY_TILE, device=q.device)
        visible = (key_pos[None, :] <= last[:, None]) & (key_pos[None, :] < seq_len)
        if window is not None:
            visible &= key_pos[None, :] > position[:, None] - window
        kt = kp[lo:lo + KEY_TILE].transpose(0, 1)  # [H, T, D]
        vt = vp[lo:lo + KEY_TILE].transpose(0, 1)
        s = torch.matmul(qh, kt.transpose(1, 2)) * scale
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vt)
        m = m_new
    out = acc / torch.where(total == 0, 1.0, total)[..., None]
    return out.transpose(0, 1)[:n].to(q.dtype)
