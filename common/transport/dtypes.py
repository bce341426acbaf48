"""The wire DType enum to and from torch dtypes, and bytes to typed tensor views."""

from __future__ import annotations

import torch

from common.pb import common_pb2

_TO_TORCH = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
}
_TO_WIRE = {v: k for k, v in _TO_TORCH.items()}


def to_torch(dtype: int) -> torch.dtype:
    """torch dtype of a wire DType; ValueError for UNSPECIFIED or unknown values."""
    try:
        return _TO_TORCH[dtype]
    except KeyError:
        raise ValueError(f"unsupported embedding dtype {dtype}") from None


def to_wire(dtype: torch.dtype) -> int:
    """Wire DType of a torch dtype."""
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel as an embedding") from None


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Reinterpret a 1-D uint8 tensor as dtype with shape (no copy)."""
    return raw.view(dtype).view(tuple(shape))
