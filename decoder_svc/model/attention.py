"""Attention over the paged KV cache: metadata, the backend interface and a plain torch reference.

One batch mixes prefill chunks and decodes. Sequence i owns the flat query rows
query_start_loc[i]:query_start_loc[i+1]; those are its newest tokens, so its context is
seq_lens[i] tokens of which the last query_len are new (causal within the chunk, full view of the
cached prefix before it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each scheduled token's K/V goes and what each sequence may attend to."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block * block_size + row) of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] cumulative query lengths (CPU, int64)
    seq_lens: torch.Tensor  # [num_seqs] context length after this step, new tokens included (CPU)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids, padded with 0 (device, int64)
    block_size: int

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return int(self.seq_lens.numel())


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the layer's new K/V into the cache.

    q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (already rotated);
    kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]. Returns [tokens, heads, head_dim].
    """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention output for every query row."""


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values at their slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gather each sequence's context from its blocks, then dense SDPA (CPU or GPU)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # Write first: a sequence's own new tokens (and a prefix another sequence shares this step)
        # must be visible to its queries.
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        bs = meta.block_size
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            q_lo, q_hi = starts[i], starts[i + 1]
            n_q = q_hi - q_lo
            n_blocks = -(-seq_len // bs)
            blocks = meta.block_tables[i, :n_blocks]
            keys = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[-2:])[:seq_len]
            values = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[-2:])[:seq_len]
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            # Query j sits at position seq_len - n_q + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(
                q[q_lo:q_hi].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=scale,
            )
            out[q_lo:q_hi] = o.transpose(0, 1)
        return out
