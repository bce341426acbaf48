"""A first-use check of the Gated DeltaNet layer's own Triton kernels on a device (the gates, the prefill
convolution and the gated output norm that load_fla pairs with fla's rules: model/gated_deltanet_fla.py), and
on a CUDA device of the chunked rule with its chunk states (built from fla's internals, which another fla
version may change: dropped, a snapshot inside a chunk cuts it again).

Each kernel runs once on a few rows of the layer's real shapes and dtype (so with the block sizes serving
will compile) and is compared with its torch formula. A kernel that fails to compile or run, or disagrees
beyond the dtype's rounding, is dropped with a warning naming it, and the layer computes that part with
torch ops (the reference path's); the rest of the fast path stays. A broken kernel on a new GPU, driver or
Triton version then costs speed, not answers.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from decoder_svc.model.gated_deltanet_fla import FLA_CHUNK, DeltaRuleKernels
from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape

log = logging.getLogger("mmserve.decoder.linear_attention")

ROWS = 5  # a fresh sequence's tokens in the check: fewer than the conv's taps reach back, and more


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # a few roundings of the dtype
    return bool(torch.isfinite(got).all()) and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def _check_gates(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device, dtype, gen) -> bool:
    heads = shape.num_v_heads
    a, b = (torch.randn(ROWS, heads, generator=gen).to(device, dtype) for _ in range(2))
    a_log, dt_bias = (torch.randn(heads, generator=gen).to(device) for _ in range(2))
    beta, g = kernels.gates(a, b, a_log, dt_bias)
    want_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return _close(beta, b.sigmoid(), dtype) and _close(g, want_g, torch.float32)


def _check_gated_norm(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device, dtype, gen) -> bool:
    dv = shape.head_v_dim
    x, gate = (torch.randn(ROWS * shape.num_v_heads, dv, generator=gen).to(device, dtype) for _ in range(2))
    weight = (torch.rand(dv, generator=gen) + 0.5).to(device, dtype)
    got = kernels.gated_norm(x, gate, weight, shape.eps)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + shape.eps)
    return _close(got, (weight.float() * h) * F.silu(gate.float()), dtype)


def _check_conv(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device, dtype, gen) -> bool:
    channels, taps = shape.conv_dim, shape.conv_kernel
    x = torch.randn(ROWS, channels, generator=gen).to(device, dtype)
    weight = (torch.randn(channels, taps, generator=gen) / taps).to(device, dtype)
    pool = torch.zeros(2, channels, taps - 1, device=device, dtype=dtype)
    # a fresh sequence over rows 0..ROWS-1: taps before its start are zeros
    codes = torch.tensor([[t - (taps - 1) + j if t - (taps - 1) + j >= 0 else -1 for j in range(taps)]
                          for t in range(ROWS)], dtype=torch.int32, device=device)
    mixed = x.new_empty(ROWS, channels)
    kernels.causal_conv(x, codes, pool, weight, mixed, normalize_channels=2 * shape.key_dim,
                        head_dim=shape.head_k_dim)
    want = F.silu(F.conv1d(x.float().t()[None], weight.float()[:, None], padding=taps - 1,
                           groups=channels)[0, :, :ROWS].t())
    qk = want[:, :2 * shape.key_dim].reshape(ROWS, -1, shape.head_k_dim)
    want[:, :2 * shape.key_dim] = (qk * torch.rsqrt(qk.square().sum(-1, keepdim=True) + 1e-6)).flatten(1)
    # the prefill's form: q, k, v apart, each key head repeated for every value head it serves
    groups = shape.num_v_heads // shape.num_k_heads
    q, k = (x.new_empty(ROWS, shape.num_k_heads * groups, shape.head_k_dim) for _ in "qk")
    v = x.new_empty(ROWS, shape.num_v_heads, shape.head_v_dim)
    kernels.causal_conv(x, codes, pool, weight, (q, k, v), normalize_channels=2 * shape.key_dim,
                        head_dim=shape.head_k_dim)
    split = [t.reshape(ROWS, -1, shape.head_k_dim).repeat_interleave(groups, dim=1).flatten(1)
             for t in want[:, :2 * shape.key_dim].chunk(2, dim=1)]
    window_codes = torch.tensor([[ROWS - (taps - 1) + j for j in range(taps - 1)]], dtype=torch.int32,
                                device=device)
    windows = pool.new_empty(1, channels, taps - 1)
    kernels.conv_windows(x, window_codes, pool, windows)
    parts_ok = all(_close(got.flatten(1), expected, dtype)
                   for got, expected in zip((q, k, v), (*split, want[:, 2 * shape.key_dim:]), strict=True))
    return (_close(mixed, want, dtype) and parts_ok
            and torch.equal(windows[0], x[ROWS - (taps - 1):].t()))


def _check_chunk_states(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device, dtype, gen) -> bool:
    """chunk_states (fla's pipeline run by model/fla_chunk_states.py, bound to fla's internals) against fla's
    public chunked rule: the output and final state of one sequence of two chunks and a few rows, and the
    state at its second chunk bound against a call that ends there."""
    heads, dk, dv, n = shape.num_v_heads, shape.head_k_dim, shape.head_v_dim, 2 * FLA_CHUNK + ROWS

    def rows(width: int) -> torch.Tensor:
        return torch.randn(1, n, heads, width, generator=gen)

    q, k = (F.normalize(rows(dk), dim=-1).to(device, dtype) for _ in "qk")
    v = rows(dv).to(device, dtype)
    g = (-0.1 * torch.rand(1, n, heads, generator=gen)).to(device)
    beta = torch.rand(1, n, heads, generator=gen).to(device, dtype)
    h0 = (0.1 * torch.randn(1, heads, dk, dv, generator=gen)).to(device)

    def rule(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.chunk(q[:, :t], k[:, :t], v[:, :t], g=g[:, :t], beta=beta[:, :t], scale=dk ** -0.5,
                             initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                             cu_seqlens=torch.tensor([0, t], device=device))

    o, final, states = kernels.chunk_states(q, k, v, g=g, beta=beta, scale=dk ** -0.5, initial_state=h0,
                                            cu_seqlens=torch.tensor([0, n], device=device))
    want_o, want_final = rule(n)
    _, at_bound = rule(2 * FLA_CHUNK)
    return (states.shape[0] == 3 and torch.equal(states[0], h0[0]) and _close(o, want_o, dtype)
            and _close(final, want_final, dtype) and _close(states[2], at_bound[0], dtype))


_CHECKS = {"gates": (_check_gates,), "gated_norm": (_check_gated_norm,),
           "causal_conv": (_check_conv, "conv_windows"), "chunk_states": (_check_chunk_states,)}
# Checked where fla runs only: elsewhere the rules are tests' stand-ins, whose calls the tests count.
_CUDA_ONLY = {"chunk_states"}


def checked(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device: torch.device, dtype: torch.dtype,
            ) -> DeltaRuleKernels:
    """`kernels` without the optional ones (gates, gated_norm, causal_conv with conv_windows, chunk_states)
    that fail their check on `device` at this layer's shapes in `dtype` (each dropped one logged as a
    warning).
    Once per (kernels, shape, device, dtype): every layer of a stack shares the result."""
    key = (kernels, shape, device, dtype)
    try:
        return _results[key]
    except KeyError:
        pass
    except TypeError:  # kernels holding unhashable callables (tests' fakes): checked every time
        return _check(kernels, shape, device, dtype)
    _results[key] = _check(kernels, shape, device, dtype)
    return _results[key]


_results: dict[tuple, DeltaRuleKernels] = {}


def _check(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape, device: torch.device, dtype: torch.dtype,
           ) -> DeltaRuleKernels:
    gen = torch.Generator().manual_seed(0)
    dropped = {}
    for name, (check, *partners) in _CHECKS.items():
        if getattr(kernels, name) is None or (name in _CUDA_ONLY and device.type != "cuda"):
            continue
        if name == "causal_conv" and not kernels.conv_supports(shape.conv_dim, shape.conv_kernel,
                                                               shape.head_k_dim):
            continue
        try:
            ok = check(kernels, shape, device, dtype, gen)
            why = "its result differs from the torch formula's"
        except Exception as exc:  # a kernel that does not compile or launch here
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            log.warning("Gated DeltaNet kernel %s dropped on %s (%s): that part runs in torch ops", name,
                        device, why)
            dropped.update({n: None for n in (name, *partners)})
    return dataclasses.replace(kernels, **dropped) if dropped else kernels
