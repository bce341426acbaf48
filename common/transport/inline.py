"""Inline transport: the embedding's bytes inside the response (works across hosts)."""

from __future__ import annotations

import torch


def to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (copied to the CPU first if needed)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return flat.cpu().numpy().tobytes()


def read_bytes(data: bytes) -> torch.Tensor:
    """A uint8 tensor over data (bytearray copy: protobuf bytes are immutable)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
