"""The paged KV cache: per layer one tensor of fixed-size blocks, addressed by flat slot numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder_svc.model.config import TextModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV pool: slot s lives in block s // block_size at row s % block_size."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @staticmethod
    def bytes_per_block(cfg: TextModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    @classmethod
    def for_model(cls, cfg: TextModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype) -> KVCacheSpec:
        """A spec with num_blocks blocks for this model."""
        return cls(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device | str) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (index 0 keys, 1 values)."""
    shape = (2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
