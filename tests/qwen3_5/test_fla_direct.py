"""The chunked rule below fla's autograd wrapper (decoder_svc/model/fla_direct.py): what reaches fla's
forward, what comes back, and when the public call is kept. The kernels themselves run in tests/gpu/
(test_gated_deltanet_fla_gpu.py goes through load_fla, so through this adapter)."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.model.fla_direct import direct


class Recorder:
    """Stands in for fla's forward (or its public call): records the call, returns fixed outputs."""

    def __init__(self, returns: tuple) -> None:
        self.returns, self.calls = returns, []

    def forward(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens))
        return self.returns

    def public(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.returns


def _inputs():
    q = torch.randn(1, 2, 10, 4).transpose(1, 2)  # [1, 10, 2, 4], not contiguous
    k = torch.randn(1, 10, 2, 4)
    v = torch.randn(1, 10, 2, 3)
    g, beta = torch.randn(1, 10, 2), torch.rand(1, 10, 2)
    state = torch.randn(2, 3, 4, 2).transpose(2, 3)  # [N, H, K, V], not contiguous
    return q, k, v, g, beta, state


def test_the_forward_gets_contiguous_inputs_and_its_o_and_final_state_come_back():
    o, final = torch.randn(1, 10, 2, 3), torch.randn(2, 2, 4, 3)
    fla = Recorder((None, o, None, final))
    public = Recorder(("public",))
    chunk = direct(public.public, fla.forward)
    q, k, v, g, beta, state = _inputs()
    cu = torch.tensor([0, 4, 10])
    got = chunk(q, k, v, g=g, beta=beta, scale=0.5, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
    assert got[0] is o and got[1] is final and not public.calls
    (call,) = fla.calls
    for name, given in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", state)):
        assert call[name].is_contiguous() and torch.equal(call[name], given), name
    assert call["scale"] == 0.5 and call["output_final_state"] is True and call["cu_seqlens"] is cu
    chunk(q, k, v, g=g, beta=beta)  # fla's defaults: scale Dk^-0.5, no initial state
    assert fla.calls[1]["scale"] == 4 ** -0.5 and fla.calls[1]["initial_state"] is None


def test_fla_s_own_l2norm_goes_through_the_public_call():
    fla, public = Recorder((None, None, None, None)), Recorder(("o", "state"))
    q, k, v, g, beta, state = _inputs()
    got = direct(public.public, fla.forward)(q, k, v, g=g, beta=beta, scale=0.5, initial_state=state,
                                             use_qk_l2norm_in_kernel=True)
    assert got == ("o", "state") and not fla.calls
    (args, kwargs), = public.calls
    assert args[0] is q and kwargs["use_qk_l2norm_in_kernel"] is True and kwargs["initial_state"] is state


def test_the_public_call_stays_where_the_forward_is_missing_or_takes_other_parameters():
    public = Recorder(()).public
    assert direct(public, None) is public

    def another_version(q, k, v, g, beta, scale, h0, cu_seqlens=None):
        raise AssertionError("not called")

    assert direct(public, another_version) is public


def test_fla_0_4_s_forward_takes_what_the_adapter_passes():
    """Where fla is installed (it imports on a CPU; its kernels do not run there)."""
    fla_chunk = pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    public = fla_chunk.chunk_gated_delta_rule
    chunk = direct(public, fla_chunk.chunk_gated_delta_rule_fwd)
    assert chunk is not public and chunk.forward is fla_chunk.chunk_gated_delta_rule_fwd
