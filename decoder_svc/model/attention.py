"""Attention over the paged KV cache: metadata, the backend interface and a plain torch reference.

One batch mixes prefill chunks and decodes. Sequence i owns the flat query rows
query_start_loc[i]:query_start_loc[i+1]; those are its newest tokens, so its context is
seq_lens[i] tokens of which the last query_len are new (causal within the chunk, full view of the
cached prefix before it). A sliding-window layer (Gemma 3's local layers) passes `window`: each query
then sees only the keys of the last `window` positions up to its own (HF's sliding_window_overlay:
key > query - window). The blocks of keys older than that are freed as the window moves (a sliding
layer reads its own KV cache group's tables, model/kv_groups.py, whose freed entries name a null block
that holds zeros: a kernel may read it for a key tile straddling the window's start, masked out).

Bidirectional image attention (Gemma 3: HF's token_type_ids block mask during prefill): an image's tokens
see each other whole. `key_limits` gives each query row the last key position it may see: its own
position for text, the last token of its image for an image token (the scheduler never splits an image
across fresh chunks, so those keys are in the cache or in the same chunk). With a window both hold:
query - window < key <= limit (HF's AND(sliding_window, OR(causal, blockwise))).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each scheduled token's K/V goes and what each sequence may attend to.

    The device tensors are all a kernel needs (a CUDA graph replays them with new contents); the CPU
    copies serve the reference backend, which slices per sequence on the host.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block * block_size + row); -1: padding, not stored
    query_start_loc: torch.Tensor  # [num_seqs + 1] cumulative query lengths (device, int32)
    seq_lens: torch.Tensor  # [num_seqs] context length after this step, new tokens included (device, int32)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids, padded with 0 (device, int32)
    block_size: int
    max_query_len: int  # the longest chunk in the batch (1: decode only)
    query_start_loc_cpu: torch.Tensor | None = None  # CPU copies for the reference backend
    seq_lens_cpu: torch.Tensor | None = None
    # [num_tokens] int64 (device): the last key position each query row may see; None: its own (causal)
    key_limits: torch.Tensor | None = None
    key_limits_cpu: torch.Tensor | None = None

    @classmethod
    def build(cls, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int,
              device: torch.device | str) -> AttentionMetadata:
        """Metadata from host lists (tests, eager steps); the runner fills persistent buffers instead."""
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return cls(torch.tensor(slot_mapping, dtype=torch.int64, device=device), starts.to(device),
                   lens.to(device), tables.to(device), block_size, max(query_lens, default=0), starts, lens)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return int(self.block_tables.shape[0])

    def host_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc and seq_lens on the host (int64)."""
        starts, lens = self.query_start_loc_cpu, self.seq_lens_cpu
        starts = self.query_start_loc.cpu() if starts is None else starts
        lens = self.seq_lens.cpu() if lens is None else lens
        return starts.long(), lens.long()

    def host_key_limits(self) -> torch.Tensor | None:
        """key_limits on the host (int64), or None (causal)."""
        if self.key_limits is None:
            return None
        limits = self.key_limits_cpu if self.key_limits_cpu is not None else self.key_limits.cpu()
        return limits.long()

    @cached_property
    def decode_plan(self) -> DecodePlan | None:
        """The single-token (decode) rows, gathered once per step for every layer; None if < 2."""
        starts, seq_lens = self.host_lens()
        seqs = ((starts[1:] - starts[:-1]) == 1).nonzero().flatten()
        if seqs.numel() < 2:
            return None
        lens = seq_lens[seqs]
        n_blocks = -(-int(lens.max()) // self.block_size)
        device = self.block_tables.device
        # Host-to-device copies happen here, once, not in every layer (each would stall the stream).
        seqs_dev = seqs.to(device, non_blocking=True)
        key_mask = torch.arange(n_blocks * self.block_size)[None, :] < lens[:, None]
        return DecodePlan(
            seqs=set(seqs.tolist()), rows=starts[seqs].to(device, non_blocking=True),
            block_tables=self.block_tables[seqs_dev, :n_blocks].long(),
            key_mask=key_mask[:, None, None, :].to(device, non_blocking=True),
            seq_lens=lens[:, None, None, None].to(device, non_blocking=True))


@dataclass(frozen=True)
class DecodePlan:
    """Where the decode rows of a step are and what each may attend to (padded to the longest)."""

    seqs: set[int]               # sequence indexes in the batch
    rows: torch.Tensor           # [n] their query rows (device)
    block_tables: torch.Tensor   # [n, max_blocks] (device)
    key_mask: torch.Tensor       # [n, 1, 1, max_blocks * block_size] True where a key exists (device)
    seq_lens: torch.Tensor       # [n, 1, 1, 1] their context lengths (device): a window's lower bound


# The ops' rotary embedding: (q, k, positions, cos_sin) -> rotated (q, k) (TorchOps.rotary's contract).
Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the layer's new K/V into the cache.

    q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (already rotated);
    kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]. Returns [tokens, heads, head_dim].
    """

    supports_cuda_graphs = False  # True when forward never synchronises with the host
    supports_sliding_window = False  # True when forward masks keys outside `window`

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """Attention output for every query row; with `window`, over the last `window` keys only."""

    def rotate_and_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                           positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """forward on q and k rotated by `rotary(q, k, positions, cos_sin)` (the layer's ops). A backend
        may rotate them in the kernel that stores K/V (Triton: one launch instead of two)."""
        q, k = rotary(q, k, positions, cos_sin)
        return self.forward(q, k, v, kv_cache, meta, scale, window)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values at their slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keep = slot_mapping >= 0  # padded rows have no slot
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


class TorchAttentionBackend(AttentionBackend):
    """Reference backend (CPU or GPU): all decode rows in one padded SDPA call, then each prefill
    chunk on its own (gather its context from its blocks, dense SDPA with a causal mask)."""

    supports_sliding_window = True
    batch_decodes = True  # single-token queries in one padded call (a subclass may take each on its own)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        # Write first: a sequence's own new tokens (and a prefix another sequence shares this step)
        # must be visible to its queries.
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.zeros_like(q)  # rows of no sequence (padding) stay zero
        starts_t, seq_lens = meta.host_lens()
        starts = starts_t.tolist()
        limits = meta.host_key_limits()
        plan = meta.decode_plan if self.batch_decodes else None
        if plan is not None:  # one kernel for every single-token query instead of one per sequence
            self._decode_batch(q, kv_cache, plan, scale, out, window)
        done = plan.seqs if plan is not None else set()
        for i, seq_len in enumerate(seq_lens.tolist()):
            q_lo, q_hi = starts[i], starts[i + 1]
            if i not in done and seq_len > 0 and q_hi > q_lo:
                out[q_lo:q_hi] = self._one_sequence(q[q_lo:q_hi], kv_cache, meta.block_tables[i], seq_len,
                                                    meta.block_size, scale, window,
                                                    None if limits is None else limits[q_lo:q_hi])
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks, [..., blocks * block_size, kv_heads, head_dim]."""
        keys, values = kv_cache[0, blocks], kv_cache[1, blocks]
        shape = (*blocks.shape[:-1], -1, *kv_cache.shape[-2:])
        return keys.reshape(shape), values.reshape(shape)

    def _one_sequence(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int, block_size: int, scale: float, window: int | None = None,
                      key_limits: torch.Tensor | None = None) -> torch.Tensor:
        n_q = q.shape[0]
        keys, values = self._gather(kv_cache, block_table[:-(-seq_len // block_size)].long())
        keys, values = keys[:seq_len], values[:seq_len]
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        # Query j sits at position seq_len - n_q + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = key_pos <= (q_pos if key_limits is None else key_limits.to(q.device)[:, None])
        if window is not None:
            mask &= key_pos > q_pos - window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        return o.transpose(0, 1)

    def _decode_batch(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, scale: float,
                      out: torch.Tensor, window: int | None = None) -> None:
        keys, values = self._gather(kv_cache, plan.block_tables)
        groups = q.shape[1] // keys.shape[2]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=2)
            values = values.repeat_interleave(groups, dim=2)
        # Padding past each sequence's length (and the blocks it does not own) is masked out; with a
        # window, so are the keys before it (the query sits at seq_len - 1).
        mask = plan.key_mask
        if window is not None:
            key_pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (key_pos > plan.seq_lens - 1 - window)
        o = F.scaled_dot_product_attention(q[plan.rows][:, :, None], keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask, scale=scale)
        out[plan.rows] = o[:, :, 0]
