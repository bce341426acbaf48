"""The oracle's guard for older transformers (common/families/qwen3_5/oracle.py): those bind fla's kernels
to each Gated DeltaNet layer when fla imports, and fla's Triton kernels fail on a CPU model's tensors (the
GPU machine's oracle runs on its CPU). The per-layer kernels become the modeling module's torch
fallbacks; a model on another device keeps them."""

from __future__ import annotations

import torch

from common.families.qwen3_5.oracle import torch_fallbacks


def fla_chunk(*args, **kwargs):
    raise AssertionError("a Triton kernel on a CPU tensor")


def torch_chunk_gated_delta_rule(*args, **kwargs):
    return "torch chunk"


def torch_recurrent_gated_delta_rule(*args, **kwargs):
    return "torch recurrent"


def torch_causal_conv1d_update(*args, **kwargs):
    return "torch conv update"


class OldGatedDeltaNet(torch.nn.Module):
    """What transformers before the per-call device check built: the kernels bound at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.chunk_gated_delta_rule = fla_chunk
        self.recurrent_gated_delta_rule = fla_chunk
        self.causal_conv1d_update = fla_chunk
        self.causal_conv1d_fn = fla_chunk


class OldModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([OldGatedDeltaNet(), OldGatedDeltaNet(), torch.nn.Linear(2, 2)])


def test_a_cpu_model_s_layers_take_the_torch_fallbacks():
    model = OldModel()
    assert torch_fallbacks(model) == 8
    for layer in model.layers[:2]:
        assert layer.chunk_gated_delta_rule() == "torch chunk"
        assert layer.recurrent_gated_delta_rule() == "torch recurrent"
        assert layer.causal_conv1d_update() == "torch conv update"
        assert layer.causal_conv1d_fn is None
    assert torch_fallbacks(model) == 0  # nothing left to replace


def test_a_model_on_another_device_keeps_its_kernels():
    model = OldModel().to("meta")
    assert torch_fallbacks(model) == 0 and model.layers[0].chunk_gated_delta_rule is fla_chunk
