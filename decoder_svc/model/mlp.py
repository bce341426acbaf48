"""The dense feed-forward block of a decoder layer (and a MoE layer's shared expert)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from decoder_svc.model.ops import TorchOps
from decoder_svc.model.parallel import all_reduce

if TYPE_CHECKING:
    from decoder_svc.model.config import TextModelConfig


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one product (GeGLU with tanh GELU
    where cfg.hidden_act says so: Gemma). Tensor-parallel (`reduce`): this rank's hidden columns, and the
    partial outputs summed over the ranks."""

    def __init__(self, cfg: TextModelConfig, ops: type[TorchOps], reduce: bool = False,
                 intermediate_size: int | None = None) -> None:
        """intermediate_size: the hidden width (default cfg.intermediate_size; a MoE's shared expert has
        its own)."""
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = ops
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The block after the gate/up product: activation and down projection (one kernel at one row)."""
        if self.gelu:
            out = self.ops.linear(self.ops.gelu_tanh_and_mul(gate_up), self.down_proj)
        else:
            out = self.ops.act_linear(gate_up, self.down_proj)
        return all_reduce(out) if self.reduce else out
