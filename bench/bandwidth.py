"""The memory-bandwidth bound of decoding: weight bytes over the device's measured copy bandwidth."""

from __future__ import annotations

import time

import torch


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second moved by a large same-device copy (each copy reads and writes nbytes)."""
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * repeats / seconds


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters (what one decode step must read at least once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def adapter_bytes(module: torch.nn.Module) -> int:
    """Bytes of one LoRA adapter's weights in a model with adapters (model/lora/batched.py's stacked
    slots, slot 0 the base model's zeros): what a step of rows with that adapter reads beyond the base."""
    from decoder_svc.model.lora import LoRALinear

    total = 0
    for m in module.modules():
        if isinstance(m, LoRALinear):
            slots = m.lora_a.shape[0] // m.rank
            total += (m.lora_a.numel() + m.lora_b.numel()) * m.lora_a.element_size() // slots
    return total


def bound_tokens_per_s(batch: int, bandwidth: float, weights: int) -> float:
    """Decode tokens/s if every step only read the weights once at the copy bandwidth (KV ignored)."""
    return batch * bandwidth / weights
