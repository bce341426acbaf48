"""What the tests of the Gated DeltaNet kernel seam share (CPU here, the GPU in tests/gpu): a random layer, a
state pool filled with noise, steps laid out as the runner lays them, and fla's calling convention
implemented by the torch reference (`FAKE_FLA`), so that the adapter's bookkeeping runs without a GPU."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import pytest
import torch

from decoder_svc.model.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetShape,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from decoder_svc.model.gated_deltanet_fla import FLA_CHUNK, DeltaRuleKernels
from decoder_svc.model.linear_state import LinearStatePool, LinearStateStep

LAYER = 5  # a linear layer's index in its stack (the pool is keyed by it)

# A test module whose Triton kernels run in Triton's interpreter (a CPU host; tests/gpu runs them compiled)
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                 reason="the Triton kernels run in Triton's interpreter here (a CPU host)")

# A sequence of a step: (tokens, start position, slot, snapshots (tokens into the chunk, snapshot slot)).
# start 0: a fresh sequence (its slot's noise must not be read); one token after 0: a decode row.
LAYOUTS = {
    "one fresh chunk": [(70, 0, 0, ())],
    "fresh chunks of several lengths": [(1, 0, 0, ()), (5, 0, 1, ()), (64, 0, 2, ()), (130, 0, 3, ())],
    "resumed and fresh chunks between decode rows": [
        (40, 12, 0, ()), (1, 30, 1, ()), (3, 0, 2, ()), (1, 7, 3, ()), (100, 64, 4, ())],
    "snapshots inside chunks": [
        (150, 0, 0, ((3, 6), (64, 7), (150, 8))), (1, 9, 1, ()), (20, 5, 2, ((10, 9),)), (30, 0, 3, ())],
    "two snapshots at one position": [(12, 0, 0, ((5, 6), (5, 7), (12, 8))), (7, 3, 1, ((7, 9),))],
    # on fla's 64-token chunk bounds from the piece's start: read from its chunk states, no cut (the second
    # sequence's at 64 + 3, after its cut at 3; the last one resumed at 9)
    "snapshots on chunk bounds": [
        (200, 0, 0, ((64, 6), (128, 7), (200, 8))), (150, 0, 1, ((3, 9), (67, 5))), (1, 4, 2, ()),
        (130, 9, 3, ((64, 4),))],
    "decode rows only": [(1, 3, 2, ()), (1, 9, 0, ()), (1, 1, 5, ())],
}
SLOTS = 10  # 0..5 requests', 6..9 snapshots'


def text_shape(key_dim: int = 16, value_dim: int = 8, hidden: int = 48, key_heads: int = 2,
               value_heads: int = 4) -> GatedDeltaNetShape:
    """A layer whose key heads serve 2 value heads each (as the 9B's 16 / 32)."""
    return GatedDeltaNetShape(hidden, key_heads, value_heads, key_dim, value_dim, 4)


@torch.no_grad()
def random_layer(shape: GatedDeltaNetShape, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    """Weights scaled so that every term matters: decays of all speeds, gates open and shut."""
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(shape).eval()
    for name, p in layer.named_parameters():
        if p.dim() >= 2:
            std = 0.5 if "conv" in name else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    layer.dt_bias.copy_(torch.randn(shape.num_v_heads, generator=gen))
    # per-token decays exp(g) from ~0.99 (a state that lasts) to ~0 (one forgotten at once)
    layer.A_log.copy_(torch.empty(shape.num_v_heads).uniform_(-4.0, 2.5, generator=gen))
    layer.norm.weight.copy_(1.0 + 0.1 * torch.randn(shape.head_v_dim, generator=gen))
    return layer.to(device=device, dtype=dtype)


def noisy_pool(shape: GatedDeltaNetShape, seed: int = 1, device: str = "cpu",
               dtype: torch.dtype = torch.float32, slots: int = SLOTS) -> LinearStatePool:
    """A pool whose every slot holds a plausible state (a resumed sequence's) or noise a fresh one must
    ignore: conv inputs of size ~1, recurrent states of size ~0.3."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(shape.conv_state_shape(slots), generator=gen).to(device=device, dtype=dtype)
    rec = (0.3 * torch.randn(shape.recurrent_state_shape(slots), generator=gen)).to(device)
    return LinearStatePool({LAYER: conv}, {LAYER: rec}, slots)


def clone_pool(pool: LinearStatePool) -> LinearStatePool:
    return LinearStatePool({k: t.clone() for k, t in pool.conv.items()},
                           {k: t.clone() for k, t in pool.recurrent.items()}, pool.num_slots)


def build_step(pool: LinearStatePool, layout: list[tuple], device: str = "cpu"
               ) -> tuple[LinearStateStep, int]:
    """The step of `layout` (rows in order) and its number of rows."""
    sequences, row = [], 0
    for n, start, slot, snapshots in layout:
        sequences.append((row, n, start, slot, snapshots))
        row += n
    return LinearStateStep.build(pool, sequences, device), row


def rows_input(rows: int, hidden: int, seed: int = 2, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    return x.to(device=device, dtype=dtype)


@dataclass
class FakeFla:
    """fla's two rules (DeltaRuleKernels' contract) computed by the torch reference, sequence by sequence,
    counting calls. Its chunked rule, as fla 0.4's, refuses fewer key heads than value heads."""

    chunk_calls: list[int] = field(default_factory=list)  # sequences per chunked call
    recurrent_calls: list[int] = field(default_factory=list)
    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)  # (rule, args, kwargs) as passed
    # with the real in-place recurrent kernel (common/kernels/delta_rule_recurrent.py, Triton's interpreter
    # on a CPU) and the other Triton kernels load_fla pairs with fla's rules (gates, the prefill conv, the
    # gated output norm):
    # (rows, sequences, over cu_seqlens: a prefill round; else decode rows) per in-place call
    in_place: bool = False
    in_place_calls: list[tuple[int, int, bool]] = field(default_factory=list)
    # with the chunked rule that also gives the states at its 64-token chunk bounds (fla_chunk_states.py):
    # snapshots there are read from them rather than cutting the chunk; its calls count in chunk_calls too
    states: bool = True
    state_calls: list[int] = field(default_factory=list)

    def kernels(self) -> DeltaRuleKernels:
        states = self.chunk_states if self.states else None
        if not self.in_place:
            return DeltaRuleKernels(self.chunk, self.recurrent, name="fake", chunk_states=states)
        from common.kernels import causal_conv
        from common.kernels.delta_rule_recurrent import supports
        from common.kernels.elementwise import delta_gates, gated_rms_norm

        return DeltaRuleKernels(self.chunk, self.recurrent, name="fake",
                                recurrent_in_place=self.recurrent_in_place, recurrent_supports=supports,
                                gated_norm=gated_rms_norm, gates=delta_gates,
                                causal_conv=causal_conv.packed_causal_conv_,
                                conv_windows=causal_conv.gather_conv_windows_,
                                conv_supports=causal_conv.supports, chunk_states=states)

    def recurrent_in_place(self, q, k, v, g, beta, state_pool, slots, scale, out, **kw):
        from common.kernels.delta_rule_recurrent import delta_rule_recurrent_

        cu = kw.get("cu_seqlens")
        sequences = q.shape[0] if cu is None else cu.shape[0] - 1
        self.in_place_calls.append((q.shape[0], sequences, cu is not None))
        delta_rule_recurrent_(q, k, v, g, beta, state_pool, slots, scale, out, **kw)

    def chunk(self, q, k, v, *, g, beta, **kw):
        self.calls.append(("chunk", (q, k, v), dict(g=g, beta=beta, **kw)))
        assert q.shape[2] == k.shape[2] == v.shape[2], "fla 0.4's chunked rule: one key head per value head"
        out, final = _per_sequence(chunk_gated_delta_rule, q, k, v, g, beta, **kw)
        self.chunk_calls.append(final.shape[0])
        return out, final

    def chunk_states(self, q, k, v, *, g, beta, scale, initial_state, cu_seqlens):
        """`chunk`, and the state each 64-token chunk starts from (fla's chunk order): the reference's
        final state over the sequence's tokens before it."""
        out, final = self.chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
        self.state_calls.append(final.shape[0])
        bounds = cu_seqlens.tolist()
        states = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            start = (initial_state[i:i + 1] if initial_state is not None
                     else final.new_zeros(1, *final.shape[1:]))
            states.append(start)
            for j in range(FLA_CHUNK, b - a, FLA_CHUNK):
                t = slice(a, a + j)
                _, before = chunk_gated_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], start)
                states.append(before)
        return out, final, torch.cat(states)

    def recurrent(self, q, k, v, *, g, beta, gk=None, gv=None, **kw):
        # fla's signature: (q, k, v, g, gk, gv, beta, ...): g and beta by keyword, never gk and gv
        assert gk is None and gv is None
        self.calls.append(("recurrent", (q, k, v), dict(g=g, beta=beta, **kw)))
        out, final = _per_sequence(recurrent_gated_delta_rule, q, k, v, g, beta, **kw)
        self.recurrent_calls.append(final.shape[0])
        return out, final


def _per_sequence(rule, q, k, v, g, beta, *, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens):
    # The reference normalises q and k and scales q by Dk^-0.5 itself: the only choices it can stand for
    # (without the in-kernel l2norm the caller has normalised them: normalising again changes ~1e-8).
    assert output_final_state and scale == q.shape[-1] ** -0.5
    if not use_qk_l2norm_in_kernel:
        assert torch.allclose(q.float().norm(dim=-1), torch.ones(()), atol=1e-4), "q not normalised"
        assert torch.allclose(k.float().norm(dim=-1), torch.ones(()), atol=1e-4), "k not normalised"
    if initial_state is None:  # fla's contract: every sequence from a zero state
        sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        initial_state = torch.zeros(sequences, v.shape[2], k.shape[-1], v.shape[-1], device=q.device)
    assert initial_state.dtype == torch.float32 and g.dtype == torch.float32
    if cu_seqlens is None:
        return rule(q, k, v, g, beta, initial_state)
    assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        out, final = rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state[i:i + 1])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)
