"""The first-use check of the Gated DeltaNet layer's own Triton kernels (decoder_svc/model/
linear_kernels_check.py), with the kernels in Triton's interpreter on a CPU host: the real kernels pass
at the layer's shapes in fp32 and bf16; one that gives a wrong result or raises is dropped (with a
warning naming it), its partner with it, and the others are kept."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

from common.kernels import causal_conv  # noqa: E402
from common.kernels.elementwise import delta_gates, gated_rms_norm  # noqa: E402
from decoder_svc.model.gated_deltanet_fla import DeltaRuleKernels  # noqa: E402
from decoder_svc.model.linear_kernels_check import checked  # noqa: E402
from tests.qwen3_5.linear_steps import text_shape  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")

CPU = torch.device("cpu")


def _unused(*args, **kwargs):
    raise AssertionError("the check runs the layer's own kernels only")


def _kernels(**overrides) -> DeltaRuleKernels:
    real = dict(gates=delta_gates, gated_norm=gated_rms_norm, causal_conv=causal_conv.packed_causal_conv_,
                conv_windows=causal_conv.gather_conv_windows_, conv_supports=causal_conv.supports)
    return DeltaRuleKernels(_unused, _unused, name="test", **{**real, **overrides})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_kernels_pass(dtype, caplog):
    kernels = _kernels()
    with caplog.at_level(logging.WARNING, logger="mmserve.decoder.linear_attention"):
        assert checked(kernels, text_shape(), CPU, dtype) is kernels
    assert not caplog.records


def test_a_wrong_or_failing_kernel_is_dropped_and_named(caplog):
    def wrong_gates(a, b, a_log, dt_bias):
        beta, g = delta_gates(a, b, a_log, dt_bias)
        return beta, g * 1.5

    def failing_conv(*args, **kwargs):
        raise RuntimeError("no such PTX")

    with caplog.at_level(logging.WARNING, logger="mmserve.decoder.linear_attention"):
        got = checked(_kernels(gates=wrong_gates, causal_conv=failing_conv), text_shape(), CPU, torch.float32)
    assert got.gates is None and got.causal_conv is None and got.conv_windows is None
    assert got.gated_norm is gated_rms_norm  # the one that works stays
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "gates dropped" in messages and "causal_conv dropped" in messages and "no such PTX" in messages


def test_wrong_conv_windows_drop_the_convolution():
    def shifted_windows(x, sources, carried, out):
        causal_conv.gather_conv_windows_(x, sources + 1, carried, out)

    got = checked(_kernels(conv_windows=shifted_windows), text_shape(), CPU, torch.float32)
    assert got.causal_conv is None and got.conv_windows is None and got.gates is delta_gates


def test_the_chunk_state_check_against_the_chunked_rule():
    """The chunk-state check (run by `checked` on a CUDA device only, where fla runs) passes the chunk states
    of the rule it checks against and fails ones read a chunk off or lost; off a CUDA device `checked` does
    not run it (the rules there are stand-ins)."""
    from decoder_svc.model.linear_kernels_check import _check_chunk_states
    from tests.qwen3_5.linear_steps import FakeFla

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(0)

    fake = FakeFla()
    kernels = fake.kernels()
    assert _check_chunk_states(kernels, text_shape(), CPU, torch.float32, gen())

    def shifted(*args, **kwargs):
        o, final, states = fake.chunk_states(*args, **kwargs)
        return o, final, states.roll(1, dims=0)

    def zeroed(*args, **kwargs):
        o, final, states = fake.chunk_states(*args, **kwargs)
        return o, final, torch.zeros_like(states)

    for wrong in (shifted, zeroed):
        bad = DeltaRuleKernels(fake.chunk, fake.recurrent, name="test", chunk_states=wrong)
        assert not _check_chunk_states(bad, text_shape(), CPU, torch.float32, gen())
        assert checked(bad, text_shape(), CPU, torch.float32).chunk_states is wrong  # not checked here
