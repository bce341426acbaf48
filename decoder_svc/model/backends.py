"""Choosing the kernels: the torch reference (any device) or Triton (CUDA).

`auto` takes Triton on a CUDA device when Triton imports, and the torch reference elsewhere; `torch` and
`triton` force one (the reference on a GPU is the baseline the GPU tests compare against).
"""

from __future__ import annotations

import torch

from decoder_svc.model.attention import AttentionBackend, TorchAttentionBackend
from decoder_svc.model.ops import TorchOps

BACKENDS = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """`torch` or `triton` for this device; raises ValueError for an unknown or impossible choice."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if not on_cuda:
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if name == "triton" and not on_cuda:
        raise ValueError("the triton backend needs a CUDA device")
    return name


def make_kernels(name: str, device: torch.device | str,
                 deterministic: bool = False) -> tuple[AttentionBackend, type[TorchOps]]:
    """The attention backend and the elementwise ops for a backend name (see resolve_backend_name);
    `deterministic`: their batch-invariant forms (model/batch_invariant.py)."""
    if resolve_backend_name(name, device) == "triton":
        if deterministic:
            from decoder_svc.model.kernel_dispatch import InvariantTritonAttentionBackend, InvariantTritonOps

            return InvariantTritonAttentionBackend(), InvariantTritonOps
        from decoder_svc.model.kernel_dispatch import TritonAttentionBackend, TritonOps

        return TritonAttentionBackend(), TritonOps
    if deterministic:
        from decoder_svc.model.batch_invariant import TiledTorchAttentionBackend

        return TiledTorchAttentionBackend(), TorchOps
    return TorchAttentionBackend(), TorchOps
