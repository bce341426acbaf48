"""Adapters applied per token row inside one batch.

Each adapted projection (our fused qkv_proj, o_proj, gate_up_proj, down_proj of a layer) is wrapped by a
LoRALinear that holds every adapter's weights stacked by slot: slot 0 is the base model (all zeros), slot
i the i-th adapter. `lora_a` [slots * R, in] and `lora_b` [out, slots * R], R the module's widest adapter
(the parts of a fused module an adapter targets side by side: q's rank, then k's, then v's columns, B
holding each part's rows only). A step gives each token row its slot (LoRASlots, one int64 per row,
filled by the runner; a CUDA graph's pad rows take slot 0), and the product adds
    y[t] += (x[t] @ A[slot[t]]^T) @ B[slot[t]]^T
on top of whatever the base product is (bf16, FP8), in the ops' `lora_add`: the torch reference
(reference.py) or the Triton kernels (common/kernels/lora.py). Shapes never depend on which adapters a
step uses, so the captured graphs serve every mix.

A forward whose rows all run the base model (slots None: the runner passes none for such a step, and
captures its CUDA graphs both ways) skips the LoRA product: `idle_base` hands the ops the base projection,
so the one-row kernels that fuse a norm or the activation into the GEMV (common/kernels/decode_gemv.py)
serve it as on a model without adapters. A step with adapters has no `weight` to fuse into: the norm or
activation, then the base product through `ops.linear` (still the one-row GEMV where that is faster),
then the LoRA product.

A forward whose rows all run one adapter that was merged at load (merged.py: the checkpoint's own,
Phi-4-multimodal's vision LoRA, as W + B @ A) runs each projection's merged copy instead, through the
same ops as the base (its one-row kernels too) and with no LoRA product: the runner asks for it per step
(the model's forward `merged_adapter=True`, which binds no slots) and captures its CUDA graphs that way
as a third set.

Tensor parallelism shards the adapters as the base weights (model/parallel.py): a column-parallel module
(q/k/v, gate/up) keeps A whole and this rank's rows of each part of B; a row-parallel one (o, down) keeps
this rank's input columns of A and B whole, so its partial products (x_rank @ A_rank^T) @ B^T add up to
the whole one in the all-reduce that sums the base product's.
"""

from __future__ import annotations

import torch
from torch import nn

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.lora.adapter import LORA_TARGETS, LoRAAdapter, module_dims
from decoder_svc.model.parallel import TensorParallel, shard_slices

# Our fused module -> its parts in row order (the checkpoint's module names).
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_BLOCK = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class LoRASlots:
    """The current step's adapter slot per token row, shared by every LoRALinear of a model; or, for a
    step whose rows all run the adapter in `merged_slot`, the merged weights (merged.py)."""

    def __init__(self, adapters: int) -> None:
        self.slots: torch.Tensor | None = None
        self.adapters = adapters  # slots after slot 0
        self._adapter_rows: dict[torch.dtype, torch.Tensor] = {}
        self.merged_slot: int | None = None  # the slot whose adapter has merged weights (merged.py)
        self.merged = False  # this forward runs the merged weights

    @property
    def active(self) -> bool:
        """True when some row of the forward may have an adapter (the LoRA product runs)."""
        return self.slots is not None

    def bind(self, slots: torch.Tensor | None, num_rows: int, merged: bool = False) -> None:
        """Take `slots` [num_rows] int64 for the next forward; None: every row on the base model, or with
        `merged` every row on merged_slot's merged weights (ValueError when no adapter was merged)."""
        if merged and self.merged_slot is None:
            raise ValueError("no adapter was merged at load")
        if slots is not None and slots.shape[0] != num_rows:
            raise ValueError(f"{slots.shape[0]} LoRA slots for {num_rows} token rows")
        if slots is not None and merged:
            raise ValueError("a forward on the merged weights takes no per-row slots")
        self.slots, self.merged = slots, merged
        self._adapter_rows = {}

    def adapter_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, adapters] in dtype: 1 where a row runs adapter i (slot i + 1), else 0. Made once per
        forward (for the stacked GEMMs of every projection, common/kernels/lora.lora_add_stacked)."""
        rows = self._adapter_rows.get(dtype)
        if rows is None:
            from common.kernels.lora import one_hot_adapters

            rows = self._adapter_rows[dtype] = one_hot_adapters(self.slots, self.adapters, dtype)
        return rows


class LoRALinear(nn.Module):
    """base(x) plus each row's adapter product (its slot's A and B)."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int,
                 slots: LoRASlots, ops: type) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.rank, self.slots, self.ops = rank, slots, ops
        # The base with the merged slot's adapter added in (merged.py); None where it targets nothing here.
        self.merged: nn.Module | None = None

    @property
    def in_features(self) -> int:
        """The base projection's input width."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base projection's output width."""
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.slots.active:
            return self.ops.linear(x, idle_base(self))
        y = self.ops.linear(x, self.base)
        return self.ops.lora_add(y, x, self.lora_a, self.lora_b, self.slots, self.rank)

    def extra_repr(self) -> str:
        merged = self.merged is not None
        return f"slots={self.lora_a.shape[0] // self.rank}, rank={self.rank}, merged={merged}"


def idle_base(proj: nn.Module) -> nn.Module:
    """proj, or the plain projection a LoRALinear runs in a forward without the LoRA product: its merged
    copy in a merged forward (its base where the merged adapter does not target it), else its base (the
    ops then treat it as any plain projection: one-row fused kernels, FP8 GEMVs)."""
    if not isinstance(proj, LoRALinear) or proj.slots.active:
        return proj
    return proj.merged if proj.slots.merged and proj.merged is not None else proj.base


def _part_rows(module: str, cfg: TextModelConfig) -> dict[str, tuple[int, int]]:
    """Rows [lo, hi) of each part (and of the whole fused module, by its own name) in our module."""
    rows, lo = {}, 0
    for part in _PARTS[module]:
        n = module_dims(part, cfg)[0]
        rows[part] = (lo, lo + n)
        lo += n
    rows[module] = (0, lo)
    return rows


def stack_module(layer: int, module: str, adapters: list[LoRAAdapter], cfg: TextModelConfig,
                 dtype: torch.dtype, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(lora_a [slots * R, in], lora_b [out, slots * R], R) of one of our modules over the adapters (slot
    i + 1 for adapters[i]); None when no adapter targets it."""
    rows = _part_rows(module, cfg)
    leaves = [leaf for leaf, (ours, _) in LORA_TARGETS.items() if ours == module]
    per_slot = [[(leaf, *ad.weights[(layer, leaf)]) for leaf in leaves if (layer, leaf) in ad.weights]
                for ad in adapters]
    rank = max((sum(a.shape[0] for _, a, _ in parts) for parts in per_slot), default=0)
    if rank == 0:
        return None
    out, inp = rows[module][1], module_dims(_PARTS[module][0], cfg)[1]
    slots = len(adapters) + 1
    lora_a = torch.zeros(slots * rank, inp)
    lora_b = torch.zeros(out, slots * rank)
    for s, parts in enumerate(per_slot, 1):
        col = s * rank
        for leaf, a, b in parts:
            lo, hi = rows[leaf]
            r = a.shape[0]
            lora_a[col:col + r] = a
            lora_b[lo:hi, col:col + r] = b
            col += r
    return lora_a.to(device, dtype), lora_b.to(device, dtype).contiguous(), rank


def shard_module(layer: int, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, cfg: TextModelConfig,
                 tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a stacked module (cfg: the whole model's): B's rows of each part for a
    column-parallel module, A's input columns for a row-parallel one."""
    block = _BLOCK[module]
    if module in ("o_proj", "down_proj"):
        cols = shard_slices(f"layers.{layer}.{block}.{module}.weight", cfg, tp)[1]
        return lora_a[:, cols].contiguous(), lora_b
    rows = _part_rows(module, cfg)
    pieces = []
    for part in _PARTS[module]:
        local = shard_slices(f"layers.{layer}.{block}.{part}.weight", cfg, tp)[0]
        lo = rows[part][0]
        pieces.append(lora_b[lo + local.start:lo + local.stop])
    return lora_a, torch.cat(pieces).contiguous()


def attach_adapters(model: nn.Module, adapters: list[LoRAAdapter],
                    full_config: TextModelConfig | None = None) -> LoRASlots | None:
    """Wrap every projection some adapter targets in a LoRALinear (slot i + 1 for adapters[i]) and give
    the model the LoRASlots its forward binds; None (nothing changed) without adapters. With tensor
    parallelism (model.tp) `full_config` is the whole model's config, the adapters' shapes."""
    if not adapters:
        return None
    tp = getattr(model, "tp", None)
    cfg = full_config if full_config is not None else model.config
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    slots = LoRASlots(len(adapters))
    for i, layer in enumerate(model.layers):
        for module, block in _BLOCK.items():
            stacked = stack_module(i, module, adapters, cfg, dtype, device)
            if stacked is None:
                continue
            lora_a, lora_b, rank = stacked
            if tp is not None:
                lora_a, lora_b = shard_module(i, module, lora_a, lora_b, cfg, tp)
            parent = getattr(layer, block)
            wrapped = LoRALinear(getattr(parent, module), lora_a, lora_b, rank, slots, model.ops)
            setattr(parent, module, wrapped)
    model.lora = slots
    return slots
