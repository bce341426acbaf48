"""The Gated DeltaNet layer (linear attention with a gated delta-rule state) in plain torch: the reference
for the GPU kernels (fla's chunked and fused-recurrent rules: model/gated_deltanet_fla.py), with its state
explicit so that a state cache can own it.

The math is Hugging Face's torch fallback for this layer (transformers 5.25: `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` / `_update`, the gated RMSNorm), op for op and with
the convolution shaped as HF's cached path shapes it: in fp32 a prefill, decode steps and later chunks give
HF's outputs and states under `generate` bit for bit (tests/qwen3_5/test_gated_deltanet.py). Parameter
names are the checkpoints' (`...linear_attn.in_proj_qkv.weight`, `conv1d.weight`, `A_log`, ...), so the
layer loads them as they are.

Per token x [hidden]:
  qkv = conv1d_causal(in_proj_qkv(x)) then SiLU   (depthwise over time, kernel K; the conv state)
  q, k [Hk, Dk] (L2-normalised, q scaled by Dk^-0.5), v [Hv, Dv]; each key head serves Hv / Hk value heads
  beta = sigmoid(in_proj_b(x)) [Hv];  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias) [Hv] (log decay)
  S <- S * exp(g);  S <- S + k (beta * (v - S^T k))^T;  o = S^T q    (S [Hv, Dk, Dv]: the recurrent state)
  out = out_proj(rmsnorm(o) * weight * silu(in_proj_z(x)))

State (GatedDeltaNetState), per sequence b of a batch of B:
  conv       [B, conv_dim, K - 1], conv_dim = 2 * Hk * Dk + Hv * Dv: the last K - 1 inputs of the
             convolution (in_proj_qkv's outputs, oldest first; zeros before the first token), the
             activations' dtype. (HF's cache keeps K columns, the oldest of which is never read.)
  recurrent  [B, Hv, Dk, Dv] fp32: S after the last token.
Both are fixed-size whatever the sequence length: one slot per sequence per layer.

`forward` is the chunked (prefill) form over [B, T] tokens, `step` the token-by-token recurrent form
(decode: T = 1); both take a state (None: a fresh sequence) and return the state after their last token,
never modifying the one passed in. A prefix's state carried into the next call continues the sequence
wherever the cut falls (inside a chunk of CHUNK_SIZE too): equal to one call over the whole sequence up
to the rounding of another chunking (the chunked and recurrent forms sum in different orders). A batch's
sequences have one length per call; decode batches any sequences, one token each, their states stacked
on dim 0.

`forward_batch`, the serving path over a step's rows and the state pool's slots, runs this reference a
chunk at a time, or, on a CUDA device where fla imports, hands the delta rule to fla-core
(model/gated_deltanet_fla.py: one varlen chunked call, with cu_seqlens, for all of the step's prefill
chunks; the fused recurrent step for its decode rows). MMSERVE_LINEAR_ATTENTION=torch keeps the reference,
=fla insists on fla. `forward` and `step` are always the reference.

In the deterministic mode (inside model/batch_invariant.py's BatchInvariantMatmuls, on any device)
`forward_batch` takes neither form per chunk nor fla: every token, of a prefill chunk as of a decode row,
runs alone through `step`'s arithmetic (conv update, recurrent rule, gated norm) from its sequence's state,
with tensors of the same shapes whatever else the step holds, so that a token's output is the same bits
however its prompt was chunked, resumed or batched (`_token_by_token`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decoder_svc.model.batch_invariant import invariant_matmuls_active
from decoder_svc.model.gated_deltanet_fla import (
    AUTO,
    DeltaRuleKernels,
    forward_packed,
    graph_rows_supported,
    kernels_for,
)
from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape, LinearStateStep
from decoder_svc.model.linear_kernels_check import checked

CHUNK_SIZE = 64  # the chunked rule's block, HF's and fla's default


@dataclass(frozen=True)
class GatedDeltaNetState:
    """A batch's state of one Gated DeltaNet layer after some tokens (shapes in the module docstring)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(cls, shape: GatedDeltaNetShape, batch: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> GatedDeltaNetState:
        """The state before any token."""
        return cls(torch.zeros(shape.conv_state_shape(batch), dtype=dtype, device=device),
                   torch.zeros(shape.recurrent_state_shape(batch), dtype=torch.float32, device=device))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as HF (and fla) compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """[B, T, H, D] / [B, T, H] inputs to fp32 [B, Hv, T, ...], keys and queries repeated over their value
    heads, normalised; queries scaled by Dk^-0.5."""
    groups = v.shape[2] // k.shape[2]
    if groups != 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk_size: int = CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over T tokens in blocks of chunk_size (HF's torch_chunk_gated_delta_rule with
    L2-normalised q and k). q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv]
    fp32 (S before the first token). Returns (o [B, T, Hv, Dv] in q's dtype, S after the last token)."""
    dtype, length = q.dtype, k.shape[1]
    q, k, v, decay, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    chunks = (length + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular once solved
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule one token at a time (HF's torch_recurrent_gated_delta_rule): the decode step's form.
    Same arguments and results as chunk_gated_delta_rule."""
    dtype = q.dtype
    q, k, v, decay, beta = _heads_first(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(v.shape[2]):
        s = s * decay[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                  decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU over x [B, C, T], continuing from conv_state [B, C, K - 1]
    (the K - 1 inputs before x; None: zeros, a fresh sequence). weight [C, K]. Returns (out [B, C, T], the
    new conv state).

    The call is shaped as HF's cached path shapes it (a CPU convolution rounds by its input's length, so
    this keeps HF's bits under `generate`): a fresh sequence left-padded to K, convolved with K - 1 zeros
    of padding (causal_conv1d_fn); a carried state prepended as HF's K columns (ours K - 1 and a zero
    column in place of the oldest, which no kept output reads), with that padding (a later prefill chunk)
    or none (`decode`, causal_conv1d_update)."""
    batch, channels, length = x.shape
    taps = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, channels, taps - 1)
        inputs = F.pad(x, (taps - length, 0)) if length < taps else x
    else:
        inputs = torch.cat([conv_state.new_zeros(batch, channels, 1), conv_state, x.to(conv_state.dtype)], -1)
    pad = 0 if decode else taps - 1
    out = F.conv1d(inputs.to(weight.dtype), weight.unsqueeze(1), None, padding=pad, groups=channels)
    # SiLU where HF applies it (on the kept slice when decoding, else on every input's output): its
    # vectorised and strided loops round differently.
    out = F.silu(out[:, :, -length:]) if decode else F.silu(out[:, :, :inputs.shape[-1]])[:, :, -length:]
    full = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1)
    return out.to(x.dtype), full[:, :, full.shape[-1] - (taps - 1):]


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times weight, gated by SiLU(z) (HF's Qwen3NextRMSNormGated: normalised
    in fp32, cast back before the weight, the gate applied in fp32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the device now (no check may copy to it then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer over [B, T, hidden] (the sequences of a batch have the same length;
    the state carries each one across calls). Submodules and parameters are named as the checkpoints'."""

    def __init__(self, shape: GatedDeltaNetShape) -> None:
        super().__init__()
        self.shape = shape
        s = shape
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        # nn.Conv1d for its [C, 1, K] weight's name and shape; run by causal_conv1d (explicit state)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False,
                                padding=s.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False)
        # forward_batch's delta-rule kernels: AUTO (kernels_for the rows' device and
        # MMSERVE_LINEAR_ATTENTION, resolved at the first batch on a device), None (this module's torch
        # reference) or kernels to use
        self.kernels: DeltaRuleKernels | str | None = AUTO
        self._resolved: tuple[torch.device, DeltaRuleKernels | None] | None = None

    def zero_state(self, batch: int, dtype: torch.dtype | None = None) -> GatedDeltaNetState:
        """The state before any token, on the layer's device (conv state in `dtype`, default the weights')."""
        weight = self.in_proj_qkv.weight
        return GatedDeltaNetState.zeros(self.shape, batch, dtype or weight.dtype, weight.device)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The input projections of x [..., hidden]: (qkv, z, b, a), row for row."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta = sigmoid(b) in b's dtype, g = the log decay in fp32) of projected rows."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def delta_rule_kernels(self, device: torch.device) -> DeltaRuleKernels | None:
        """The kernels forward_batch takes on `device` (None: the torch reference); AUTO is resolved once
        per device, not at every layer's every step."""
        if self.kernels != AUTO:
            return self.kernels
        if self._resolved is None or self._resolved[0] != device:
            kernels = kernels_for(device)
            if kernels is not None:
                if _capturing(device):  # checked at the first eager step
                    return kernels
                kernels = checked(kernels, self.shape, device, self.in_proj_qkv.weight.dtype)
            self._resolved = (device, kernels)
        return self._resolved[1]

    def runs_graph_rows(self, device: torch.device) -> bool:
        """Whether forward_batch takes a CUDA graph's small step (LinearGraphRows) on `device`: its kernels
        there include the in-place ones for this layer's shapes."""
        kernels = self.delta_rule_kernels(device)
        return kernels is not None and graph_rows_supported(kernels, self.shape)

    def _core(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: GatedDeltaNetState | None,
              recurrent: bool) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """Convolution and delta rule over projected [B, T, ...] inputs -> (o [B, T, Hv, Dv] before the
        gated norm, the state after the last token)."""
        s = self.shape
        batch, length, _ = qkv.shape
        conv_state = None if state is None else state.conv
        recurrent_state = state.recurrent if state is not None else torch.zeros(
            s.recurrent_state_shape(batch), dtype=torch.float32, device=qkv.device)
        mixed, conv_state = causal_conv1d(qkv.transpose(1, 2), conv_state, self.conv1d.weight.squeeze(1),
                                          decode=recurrent)
        q, k, v = torch.split(mixed.transpose(1, 2), [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.reshape(batch, length, -1, s.head_k_dim)
        k = k.reshape(batch, length, -1, s.head_k_dim)
        v = v.reshape(batch, length, -1, s.head_v_dim)
        beta, g = self._gates(b, a)
        rule = recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
        o, final = rule(q, k, v, g, beta, recurrent_state)
        return o, GatedDeltaNetState(conv_state, final)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated norm of each head's output: o [..., Hv, Dv], z [..., value_dim] -> [..., value_dim]."""
        dv = self.shape.head_v_dim
        return self.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(z.shape)

    def _out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated norm of each head's output and the output projection: o [..., Hv, Dv], z [..., value_dim]
        -> [..., hidden]."""
        return self.out_proj(self._gated_norm(o, z))

    def _mix(self, x: torch.Tensor, state: GatedDeltaNetState | None, recurrent: bool
             ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        qkv, z, b, a = self._project(x)
        o, final = self._core(qkv, b, a, state, recurrent)
        return self._out(o, z), final

    def forward_batch(self, x: torch.Tensor, step: LinearStateStep, layer: int) -> torch.Tensor:
        """The layer over a step's flat token rows x [N, hidden] (model/linear_state.py): each chunk from
        its slot's state (a zero one where it starts its sequence) in the chunked form, in pieces cut at
        its snapshot positions (the state there copied into their slots), the single-token continuations
        together in the recurrent form; the slots are left holding the states after them.

        On a CUDA device with fla (model/gated_deltanet_fla.py, `self.kernels`), the same through fla's
        kernels: the chunks packed into one varlen call (one per snapshot cut), the decode rows in its fused
        recurrent step; equal up to the rounding of other kernels."""
        qkv, z, b, a = self._project(x)
        # a graph's step (LinearGraphRows) runs on the kernels alone (forward_packed checks which it needs)
        graph = step.graph is not None
        if graph and (invariant_matmuls_active() or self.delta_rule_kernels(x.device) is None):
            raise ValueError("a graph's step (LinearGraphRows) needs this layer's in-place kernels, outside "
                             "the deterministic mode")
        if invariant_matmuls_active():  # the deterministic mode (model/batch_invariant.py)
            return self.out_proj(self._token_by_token(qkv, z, b, a, step, layer))
        kernels = self.delta_rule_kernels(x.device)
        if kernels is not None:
            beta, g = kernels.gates(a, b, self.A_log, self.dt_bias) if kernels.gates else self._gates(b, a)
            mix = functools.partial(forward_packed, qkv, beta, g, self.conv1d.weight.squeeze(1), self.shape,
                                    layer=layer, kernels=kernels)
            # a piecewise graph runs the mixing between its pieces (runner/piecewise_graphs.py)
            o = mix(step) if step.piecewise is None else step.piecewise(mix, x.shape[0])
            if kernels.gated_norm is None:
                return self._out(o, z)
            dv = self.shape.head_v_dim
            normed = kernels.gated_norm(o.reshape(-1, dv), z.reshape(-1, dv), self.norm.weight, self.norm.eps)
            return self.out_proj(normed.reshape(z.shape))
        conv_pool, rec_pool = step.pool.conv[layer], step.pool.recurrent[layer]
        o = x.new_empty(x.shape[0], self.shape.num_v_heads, self.shape.head_v_dim)
        if step.decode_rows is not None:
            rows, slots = step.decode_rows, step.decode_slots
            state = GatedDeltaNetState(conv_pool[slots], rec_pool[slots])
            out, new = self._core(qkv[rows, None], b[rows, None], a[rows, None], state, recurrent=True)
            o[rows] = out[:, 0]
            conv_pool[slots], rec_pool[slots] = new.conv, new.recurrent
        for c in step.chunks:
            lo, slot = c.first_row, c.slot
            state = None if c.fresh else GatedDeltaNetState(conv_pool[slot:slot + 1], rec_pool[slot:slot + 1])
            cuts = [(c.first_row + k, s) for k, s in c.snapshots]
            for hi in sorted({row for row, _ in cuts} | {c.end_row}):
                out, state = self._core(qkv[None, lo:hi], b[None, lo:hi], a[None, lo:hi], state,
                                        recurrent=False)
                o[lo:hi] = out[0]
                for row, snap in cuts:
                    if row == hi:
                        conv_pool[snap], rec_pool[snap] = state.conv[0], state.recurrent[0]
                lo = hi
            conv_pool[slot], rec_pool[slot] = state.conv[0], state.recurrent[0]
        return self._out(o, z)

    def _token_by_token(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                        step: LinearStateStep, layer: int) -> torch.Tensor:
        """forward_batch's deterministic form up to the output projection (the gated norm's rows
        [N, value_dim]): every token of every sequence, a prompt's as a decode row's, on its own through
        the one-step update (conv update, recurrent rule, gated norm) from its sequence's state, with
        tensors of the same shapes whatever the step holds. A token's result then depends on its
        sequence's tokens only: not on the chunking, on decode against prefill, nor on the other rows (the
        chunked rule's blocks follow where a chunk starts, and batched elementwise and reduction kernels
        may round a row by where it falls in the batch). Snapshots are the states after their tokens."""
        conv_pool, rec_pool = step.pool.conv[layer], step.pool.recurrent[layer]
        normed = torch.empty_like(z)

        def one(row: slice | torch.Tensor, state: GatedDeltaNetState) -> GatedDeltaNetState:
            # row selects one row, keeping the dim: [1, ...] inputs, a [1, 1, ...] token
            o, state = self._core(qkv[row, None], b[row, None], a[row, None], state, recurrent=True)
            normed[row] = self._gated_norm(o[:, 0], z[row])
            return state

        if step.decode_rows is not None:
            # one row at a time, indexed by tensors (no host sync: a decode step may be a CUDA graph)
            for i in range(step.decode_rows.shape[0]):
                slot = step.decode_slots[i:i + 1]
                state = one(step.decode_rows[i:i + 1], GatedDeltaNetState(conv_pool[slot], rec_pool[slot]))
                conv_pool[slot], rec_pool[slot] = state.conv, state.recurrent
        for c in step.chunks:
            # a fresh sequence from an explicit zero state: the same shapes as any later token
            state = (GatedDeltaNetState.zeros(self.shape, 1, conv_pool.dtype, conv_pool.device) if c.fresh
                     else GatedDeltaNetState(conv_pool[c.slot:c.slot + 1], rec_pool[c.slot:c.slot + 1]))
            for row in range(c.first_row, c.end_row):
                state = one(slice(row, row + 1), state)
                for k, snap in c.snapshots:  # (tokens into the chunk, slot)
                    if k == row + 1 - c.first_row:
                        conv_pool[snap], rec_pool[snap] = state.conv[0], state.recurrent[0]
            conv_pool[c.slot], rec_pool[c.slot] = state.conv[0], state.recurrent[0]
        return normed

    def forward(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
                ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The chunked form (prefill, or a chunk of one): x [B, T, hidden] after the state's tokens (None:
        the first tokens) -> (out [B, T, hidden], the state after x)."""
        return self._mix(x, state, recurrent=False)

    def step(self, x: torch.Tensor, state: GatedDeltaNetState) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The recurrent form (decode): x [B, T, hidden], usually T = 1, token by token from the state."""
        return self._mix(x, state, recurrent=True)
