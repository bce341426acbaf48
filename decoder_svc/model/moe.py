"""The sparse mixture-of-experts feed-forward of a MoE text stack (TextModelConfig.num_experts > 0).

Each token's router logits (a bias-free product, `gate`) go through a softmax in fp32; the top_k experts
are kept and, where the checkpoint says so (`moe_renormalize`), their probabilities are rescaled to sum to
one, then cast to the model's dtype. Each chosen expert runs a SwiGLU MLP and the outputs are summed,
weighted. The experts' weights are two stacked tensors, as Hugging Face 5.x keeps them:
`experts.gate_up_proj` [experts, 2 * I, hidden] (gate rows, then up rows) and `experts.down_proj`
[experts, hidden, I] (`expert_weights_from_checkpoint` reads the older transposed layout and one module
per expert too).

A layer may also have a shared expert (cfg.shared_expert_intermediate_size > 0, Qwen3.5-MoE): a dense
SwiGLU MLP run on every token, its output scaled by sigmoid(`shared_expert_gate`(x)) and added to the
routed experts' sum, as HF's Qwen2-MoE-style block computes it.

Two paths compute the experts: the torch reference (`experts_reference`: assignments sorted by expert,
one product per expert over its grouped rows, the weighted outputs added in expert order; the rounding
points of HF's loop, so fp32 on a CPU gives HF's bits), and on CUDA with the Triton ops the fused kernels
(common/kernels/moe_tuning.py's routed_experts: the router's softmax and top-k in one launch, then
fused_moe.py's block-aligned sort and grouped GEMMs, or at a few tokens moe_gemv.py's GEMVs that route
themselves; no host sync, so decode steps can be captured in CUDA graphs). FP8 experts (`--quantization fp8`,
decoder_svc/model/quant/experts.py) take both paths too: the reference dequantizes each expert it runs as
TorchOps.fp8_linear does, the kernels widen the FP8 tiles and scale their fp32 accumulators.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from decoder_svc.model.mlp import MLP
from decoder_svc.model.ops import TorchOps
from decoder_svc.model.quant.fp8 import dequantize, per_channel_block

if TYPE_CHECKING:
    from decoder_svc.model.config import TextModelConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in logits' dtype, expert ids [T, top_k] int64) of router logits [T, experts]:
    softmax in fp32, the top_k largest (torch.topk's order and tie-breaking), renormalised in fp32 to sum
    to one when `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                      down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k]'s SwiGLU MLP of x[t], for x [T, H] (the torch
    reference). The (token, slot) assignments are sorted by expert, slot-major within one (the rows HF's
    loop gathers, in its order); each expert with rows runs two products over them; each output is
    weighted in x's dtype and added into the result expert by expert (HF's index_add_). FP8 experts
    (scales [experts, N, 1] given): each expert used is dequantized in fp32 and rounded once to x's dtype
    before its product, as TorchOps.fp8_linear does."""
    tokens = x.shape[0]
    out = torch.zeros_like(x)
    flat = ids.t().reshape(-1)  # slot-major: assignment j is (token j % T, slot j // T)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chosen = order[start:start + count]
        start += count
        rows, slots = chosen % tokens, chosen // tokens
        gate, up = F.linear(x[rows], _expert_weight(gate_up, gate_up_scale, expert, x.dtype)).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, _expert_weight(down, down_scale, expert, x.dtype))
        out.index_add_(0, rows, h * weights[rows, slots, None])
    return out


def _expert_weight(stacked: torch.Tensor, scale: torch.Tensor | None, expert: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] weight in `dtype`: as stored, or FP8 dequantized per output channel."""
    if scale is None:
        return stacked[expert]
    return dequantize(stacked[expert], scale[expert], per_channel_block(stacked.shape[2]), dtype)


class Experts(nn.Module):
    """The stacked experts' weights (HF's parameter names and layout)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up scales, down scales): None, None for weights in the model's dtype (quant/experts.py's
        Fp8Experts has FP8 weights and per-channel scales)."""
        return None, None


class SparseMoE(nn.Module):
    """Router and experts of one layer; forward(x [T, hidden]) -> [T, hidden]. `ops` picks the path: the
    fused Triton kernels for a CUDA tensor under any ops but the torch reference's, else the reference."""

    def __init__(self, cfg: TextModelConfig, ops: type[TorchOps], reduce: bool = False) -> None:
        super().__init__()
        if reduce:
            raise ValueError(f"{cfg.model_type}: tensor parallelism of mixture-of-experts layers is not "
                             "supported")
        if cfg.hidden_act != "silu":
            raise ValueError(f"{cfg.model_type}: experts with hidden_act {cfg.hidden_act!r}; only silu")
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.moe_renormalize
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.ops = ops
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        # The deterministic mode's ops take the reference: its per-expert products go through the mode's
        # batch-invariant matmul, where the fused kernel's tiles follow the batch's routing.
        self.fused = ops is not TorchOps and not getattr(ops, "batch_invariant", False)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, ops, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x)
        if self.shared_expert is None:
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum."""
        logits = self.ops.linear(x, self.gate)  # one row: the tuned one-row kernel where it is faster
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        gate_up_scale, down_scale = self.experts.scales()
        if self.fused and x.is_cuda:
            from common.kernels.moe_tuning import routed_experts

            return routed_experts(x, logits, self.top_k, self.renormalize, gate_up, down, gate_up_scale,
                                  down_scale)
        weights, ids = route(logits, self.top_k, self.renormalize)
        return experts_reference(x, weights, ids, gate_up, down, gate_up_scale, down_scale)


def expert_weights_from_checkpoint(state: dict[str, torch.Tensor], cfg: TextModelConfig) -> None:
    """Bring a checkpoint's stacked expert tensors (in `state`, under our names) to our layout, in place.
    HF 5.x saves gate_up_proj [E, 2I, H] and down_proj [E, H, I]; the released checkpoints (and HF 4.x)
    keep them transposed, [E, H, 2I] and [E, I, H]. As HF's loader does, a tensor already of our shape is
    taken as it is (also where the two shapes coincide, H = 2I or H = I); another one is transposed."""
    if not cfg.num_experts:
        return
    stack_expert_modules(state, cfg.num_experts)
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    ours = {"experts.gate_up_proj": (2 * inter, hidden), "experts.down_proj": (hidden, inter)}
    for name in [n for n in state if n.endswith(tuple(ours))]:
        rows, cols = next(shape for suffix, shape in ours.items() if name.endswith(suffix))
        tensor = state[name]
        if tuple(tensor.shape[1:]) == (rows, cols):
            continue
        if tuple(tensor.shape[1:]) != (cols, rows):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} is neither [E, {rows}, {cols}] nor its "
                             "transpose")
        state[name] = tensor.transpose(1, 2).contiguous()


_EXPERT_MODULE = re.compile(
    r"^(?P<prefix>.*experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stack_expert_modules(state: dict[str, torch.Tensor], num_experts: int) -> None:
    """One module per expert (`experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]:
    Qwen2-MoE's layout, in which HF 5.x saves Qwen3.5-MoE) to the stacked tensors, in place:
    `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `experts.down_proj`
    [E, H, I]. A layer's experts must all be there."""
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in state if "experts." in n]:
        match = _EXPERT_MODULE.match(name)
        if match is not None:
            by_proj = layers.setdefault(match["prefix"], {})
            by_proj.setdefault(match["proj"], {})[int(match["expert"])] = state.pop(name)
    for prefix, by_proj in layers.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            found = sorted(by_proj.get(proj, {}))
            if found != list(range(num_experts)):
                raise ValueError(f"{prefix}*.{proj}: the checkpoint has {len(found)} of the {num_experts} "
                                 "experts")
        gate, up, down = (by_proj[p] for p in ("gate_proj", "up_proj", "down_proj"))
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]])
                                                      for e in range(num_experts)])
        state[prefix + "down_proj"] = torch.stack([down[e] for e in range(num_experts)])

