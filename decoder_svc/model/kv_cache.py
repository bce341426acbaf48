"""The paged KV cache: per layer one tensor of fixed-size blocks, addressed by flat slot numbers.

Layers of one KV cache group (model/kv_groups.py) share a block pool: their tensors have the group's
block count and the same block ids mean the same tokens in each. A hybrid stack's linear-attention layers
are in no group: their tensors here are empty (their state lives in model/linear_state.py's pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.kv_groups import KVCacheGroup


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV pool: slot s lives in block s // block_size at row s % block_size. `num_blocks` is
    group 0's pool (the full layers'); `groups` (empty: one pool for every layer) size each group."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    groups: tuple[KVCacheGroup, ...] = ()

    @staticmethod
    def bytes_per_block(cfg: TextModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all attention layers, keys and values."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(cfg.attention_layers) * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    @classmethod
    def for_model(cls, cfg: TextModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype) -> KVCacheSpec:
        """A spec with num_blocks blocks for this model (one pool for every attention layer)."""
        groups = (KVCacheGroup(cfg.attention_layers, None, num_blocks),) if cfg.linear_layers else ()
        return cls(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, groups)

    @classmethod
    def for_groups(cls, cfg: TextModelConfig, groups: list[KVCacheGroup], block_size: int,
                   dtype: torch.dtype) -> KVCacheSpec:
        """A spec with one pool per group (sized groups: kv_groups.split_kv_blocks)."""
        return cls(groups[0].num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                   tuple(groups))

    @property
    def pools(self) -> tuple[KVCacheGroup, ...]:
        """The sized groups; one full group of every layer when the spec has none."""
        return self.groups or (KVCacheGroup(tuple(range(self.num_layers)), None, self.num_blocks),)

    def layer_blocks(self, layer: int) -> int:
        """Physical blocks of layer `layer`'s tensor (0 for a layer of no group: a linear-attention one)."""
        for group in self.groups:
            if layer in group.layers:
                return group.num_physical_blocks
        return 0 if self.groups else self.num_blocks


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device | str) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (index 0 keys, 1 values), with
    its group's block count. Zeros: a sliding group's null block must hold finite values."""
    return [torch.zeros((2, spec.layer_blocks(i), spec.block_size, spec.num_kv_heads, spec.head_dim),
                        dtype=spec.dtype, device=device) for i in range(spec.num_layers)]
