"""FP8 mixture-of-experts weights: the stacked experts of a MoE layer (decoder_svc/model/moe.py) quantized
per expert and output channel at load (`--quantization fp8`), and the module that holds them.

Layout: `experts.gate_up_proj` float8_e4m3fn [experts, 2 * I, hidden] with `experts.gate_up_proj_scale`
fp32 [experts, 2 * I, 1], `experts.down_proj` float8_e4m3fn [experts, hidden, I] with
`experts.down_proj_scale` fp32 [experts, hidden, 1]: each expert's matrix is quant/fp8.py's per-channel
layout (q * scale of its row). The router (`mlp.gate`) stays in the model's dtype, like the lm_head.

FP8 checkpoints whose experts are quantized (stacked or one module per expert) are refused at start-up:
their block scales would need the kernels' block-scaled variant, which is not written.
"""

from __future__ import annotations

import torch
from torch import nn

from common.checkpoint import CheckpointError
from decoder_svc.model.quant.formats import Fp8Format
from decoder_svc.model.quant.fp8 import FP8_DTYPE, quantize_per_channel

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")  # a MoE layer's stacked expert tensors
SCALE_SUFFIX = "_scale"  # experts.gate_up_proj -> experts.gate_up_proj_scale


class Fp8Experts(nn.Module):
    """A MoE layer's experts in FP8 (this module's layout); Experts' interface (moe.py)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device: torch.device | str) -> None:
        super().__init__()

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj = param(num_experts, 2 * intermediate, hidden, dtype=FP8_DTYPE)
        self.gate_up_proj_scale = param(num_experts, 2 * intermediate, 1, dtype=torch.float32)
        self.down_proj = param(num_experts, hidden, intermediate, dtype=FP8_DTYPE)
        self.down_proj_scale = param(num_experts, hidden, 1, dtype=torch.float32)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up scales, down scales), fp32 [experts, rows, 1]."""
        return self.gate_up_proj_scale, self.down_proj_scale


def is_expert_scale(name: str) -> bool:
    """True for an FP8 expert scale's state name (kept in fp32 when the rest is cast to the model dtype)."""
    return name.endswith(tuple(w + SCALE_SUFFIX for w in EXPERT_WEIGHTS))


@torch.no_grad()
def quantize_experts(state: dict[str, torch.Tensor], device: torch.device | str) -> list[str]:
    """`--quantization fp8` for MoE layers: quantize every stacked expert tensor of `state` (in place, on
    `device`) per expert and output channel, adding its scale; returns the experts modules' names
    (`layers.N.mlp.experts`). One expert at a time, so the fp32 copy stays one matrix large."""
    modules = set()
    for name in [n for n in state if n.startswith("layers.") and n.endswith(EXPERT_WEIGHTS)]:
        stacked = state[name]
        q = torch.empty(stacked.shape, dtype=FP8_DTYPE, device=device)
        scale = torch.empty(*stacked.shape[:2], 1, dtype=torch.float32, device=device)
        for expert in range(stacked.shape[0]):
            q[expert], scale[expert] = quantize_per_channel(stacked[expert].to(device))
        state[name], state[name + SCALE_SUFFIX] = q, scale
        modules.add(name.rsplit(".", 1)[0])
    return sorted(modules)


def swap_in_fp8_experts(model: nn.Module, modules: list[str]) -> None:
    """Replace each Experts module named in `modules` by an empty Fp8Experts of its shape on its device;
    the caller then loads the FP8 weights and scales into it."""
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        experts, two_i, hidden = old.gate_up_proj.shape
        setattr(parent, child, Fp8Experts(experts, hidden, two_i // 2, old.gate_up_proj.device))


def refuse_fp8_experts(state: dict[str, torch.Tensor], fmt: Fp8Format) -> None:
    """CheckpointError for an FP8 checkpoint whose experts are quantized (FP8 expert tensors, or scales
    beside them); a checkpoint whose experts stayed in bf16 loads (its other FP8 projections are served)."""
    quantized = [n for n, t in state.items() if ".experts." in n
                 and (t.dtype == FP8_DTYPE or "scale" in n.rsplit(".", 1)[-1])]
    if quantized:
        raise CheckpointError(f"{fmt.name} checkpoint: FP8 mixture-of-experts weights ({quantized[0]}, "
                              f"{len(quantized)} tensors) are not supported; serve the bf16 checkpoint with "
                              "--quantization fp8, which quantizes the experts per channel at load")
