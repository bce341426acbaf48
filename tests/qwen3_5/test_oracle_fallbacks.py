"""The oracle's guard for older transformers (common/families/qwen3_5/oracle.py): those bind fla's kernels
to each Gated DeltaNet layer when fla imports, and fla's Triton kernels fail on a CPU model's tensors (the
GPU machine's oracle runs on its CPU). The per-layer kernels become the modeling module's torch
fallbacks; a model on another device keeps them."""

from __future__ import annotations

import functools
import sys
import types

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

from common.families.qwen3_5.oracle import torch_fallbacks, torch_paths


def fla_chunk(*args, **kwargs):
    raise AssertionError("a Triton kernel on a CPU tensor")


def torch_chunk_gated_delta_rule(*args, **kwargs):
    return "torch chunk"


def torch_recurrent_gated_delta_rule(*args, **kwargs):
    return "torch recurrent"


def torch_causal_conv1d_update(*args, **kwargs):
    return "torch conv update"


class FusedRMSNormGated(torch.nn.Module):
    """fla's fused gated norm, as older transformers built it whenever fla imported."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x, gate):
        raise AssertionError("a Triton kernel on a CPU tensor")


class OldGatedDeltaNet(torch.nn.Module):
    """What transformers before the per-call device check built: the kernels bound at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.chunk_gated_delta_rule = fla_chunk
        self.recurrent_gated_delta_rule = fla_chunk
        self.causal_conv1d_update = fla_chunk
        self.causal_conv1d_fn = fla_chunk
        self.norm = FusedRMSNormGated(8, eps=1e-6)


class OldModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([OldGatedDeltaNet(), OldGatedDeltaNet(), torch.nn.Linear(2, 2)])


def test_a_cpu_model_s_layers_take_the_torch_fallbacks():
    model = OldModel()
    weight = model.layers[0].norm.weight.detach().clone()
    assert torch_fallbacks(model) == 10
    for layer in model.layers[:2]:
        assert layer.chunk_gated_delta_rule() == "torch chunk"
        assert layer.recurrent_gated_delta_rule() == "torch recurrent"
        assert layer.causal_conv1d_update() == "torch conv update"
        assert layer.causal_conv1d_fn is None
    norm = model.layers[0].norm
    assert isinstance(norm, Qwen3_5RMSNormGated) and torch.equal(norm.weight, weight)
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    reference = normed * weight * torch.nn.functional.silu(gate)
    torch.testing.assert_close(norm(x, gate), reference)
    assert torch_fallbacks(model) == 0  # nothing left to replace


def test_a_model_on_another_device_keeps_its_kernels():
    model = OldModel().to("meta")
    assert torch_fallbacks(model) == 0 and model.layers[0].chunk_gated_delta_rule is fla_chunk


def _dispatching(torch_function):
    """What some transformers versions wrap each fallback in: fla's kernel whenever fla imports."""
    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        return fla_chunk(*args, **kwargs)
    return wrapped


def test_fallbacks_under_a_device_blind_dispatcher_run_as_torch():
    modeling = types.ModuleType("old_modeling")
    modeling.torch_chunk_gated_delta_rule = _dispatching(torch_chunk_gated_delta_rule)

    class Layer(torch.nn.Module):
        chunk_gated_delta_rule = None

        def forward(self):  # the layer calls the module-level name
            return modeling.torch_chunk_gated_delta_rule()

    Layer.__module__ = "old_modeling"
    sys.modules["old_modeling"] = modeling
    try:
        layer = Layer()
        layer.proj = torch.nn.Linear(2, 2)
        layer.chunk_gated_delta_rule = modeling.torch_chunk_gated_delta_rule  # bound at construction
        assert torch_fallbacks(layer) == 1 and layer.chunk_gated_delta_rule() == "torch chunk"
        dispatcher = modeling.torch_chunk_gated_delta_rule
        with torch_paths(modeling):
            assert layer() == "torch chunk"
        assert modeling.torch_chunk_gated_delta_rule is dispatcher  # restored
    finally:
        del sys.modules["old_modeling"]
