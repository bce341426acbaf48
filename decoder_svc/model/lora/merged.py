"""A built-in adapter merged into a second copy of the projections it targets, for steps whose rows all
run it.

Every image request of Phi-4-multimodal runs the checkpoint's own vision LoRA (builtin.py). A step whose
rows all run it needs no per-row product: each targeted projection's merged copy W + B @ A (the
scaling already in B) gives the same outputs from one plain product, through the base's kernels (the
one-row GEMVs too), reading no adapter weights. Steps mixing it with the base model or another adapter
keep the LoRA path (batched.py); the runner picks per step (model_runner.py) and LoRASlots tells each
LoRALinear which copy a forward runs.

The copies are made once at load, the sum in fp32 then cast to the model's dtype, on this rank's shard
of each weight under tensor parallelism (the sharded A and B multiply to exactly the shard of B @ A: B's
rows of a column-parallel module, A's columns of a row-parallel one). They are buffers of the copy, not
parameters: a step reads one copy or the other, so the model's weight bytes (a decode step's bandwidth
bound) stay the base's. They cost the targeted projections' bytes again: for Phi-4-multimodal, whose
adapter targets every layer's qkv, o, gate_up and down projections, all of its decoder layers' weights
(about 0.84 of the language model's, the rest being the tied embedding); the start-up log gives the bytes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.lora.adapter import LORA_TARGETS, LoRAAdapter
from decoder_svc.model.lora.batched import _BLOCK, LoRALinear, shard_module, stack_module

log = logging.getLogger("mmserve.decoder.lora")


def targeted(model: nn.Module, adapter: LoRAAdapter) -> list[tuple[int, str, LoRALinear]]:
    """(layer, module, its LoRALinear) of every projection of ours `adapter` targets."""
    modules = {(layer, LORA_TARGETS[leaf][0]) for layer, leaf in adapter.weights}
    found = []
    for i, layer in enumerate(model.layers):
        for module, block in _BLOCK.items():
            proj = getattr(getattr(layer, block), module)
            if (i, module) in modules and isinstance(proj, LoRALinear):
                found.append((i, module, proj))
    return found


def merged_bytes(model: nn.Module, adapter: LoRAAdapter) -> int:
    """Bytes the merged copies of `adapter`'s projections take (their base weights' bytes, this rank's)."""
    return sum(p.base.weight.numel() * p.base.weight.element_size() for _, _, p in targeted(model, adapter))


def merged_linear(base: nn.Linear, delta: torch.Tensor) -> nn.Linear:
    """A Linear computing with base.weight + delta (summed in fp32, cast to base's dtype), its weight a
    buffer, its bias base's own."""
    weight = (base.weight.float() + delta).to(base.weight.dtype).contiguous()
    merged = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
    del merged.weight
    merged.register_buffer("weight", weight, persistent=False)
    merged.bias = base.bias
    return merged


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: LoRAAdapter, slot: int,
                  full_config: TextModelConfig | None = None) -> int:
    """Give every LoRALinear `adapter` targets its merged copy (LoRALinear.merged) and mark `slot` (the
    adapter's) as merged in model.lora; returns the copies' bytes. ValueError for a base projection that
    is not a plain Linear of a float dtype (FP8 projections are not merged). full_config: the whole
    model's under tensor parallelism (the adapter's shapes)."""
    tp = getattr(model, "tp", None)
    cfg = full_config if full_config is not None else model.config
    total = 0
    for i, module, proj in targeted(model, adapter):
        base = proj.base
        if type(base) is not nn.Linear or base.weight.dtype not in (torch.float32, torch.bfloat16,
                                                                    torch.float16):
            raise ValueError(f"layer {i} {module}: only plain float projections are merged, not "
                             f"{type(base).__name__}")
        device = base.weight.device
        a, b, rank = stack_module(i, module, [adapter], cfg, torch.float32, device)
        if tp is not None:
            a, b = shard_module(i, module, a, b, cfg, tp)
        proj.merged = merged_linear(base, b[:, rank:] @ a[rank:])  # slot 1 of the two stacked
        total += proj.merged.weight.numel() * proj.merged.weight.element_size()
    model.lora.merged_slot = slot
    return total


def maybe_merge_builtin(model: nn.Module, adapter: LoRAAdapter, slot: int, full_config: TextModelConfig,
                        refusal: str | None = None) -> int:
    """merge_adapter for a checkpoint's own adapter, unless `refusal` (the reason it must not be merged)
    or, on a GPU, the copies would take more than half the memory still free (then the KV cache would
    pay for them); logs what it did and its cost. Returns the bytes merged (0: not merged)."""
    flag = "--no-merge-builtin-adapter turns merging off"
    if refusal is not None:
        log.info("built-in adapter %r not merged: %s; its rows run the LoRA product", adapter.name, refusal)
        return 0
    need = merged_bytes(model, adapter)
    device = model.embed_tokens.weight.device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > free // 2:
            log.warning("built-in adapter %r not merged: its merged projections would take %.2f GiB of the "
                        "%.2f GiB free; its rows run the LoRA product", adapter.name, need / 2**30,
                        free / 2**30)
            return 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = merge_adapter(model, adapter, slot, full_config)
    log.info("built-in adapter %r merged into %d projections for steps whose rows all run it: %.2f GiB, "
             "%.2fx the language model's weights (%s)", adapter.name,
             len(targeted(model, adapter)), total / 2**30, total / max(weights, 1), flag)
    return total
