"""A graph step's input embeddings: each token row's embedding, its id first taken from the last step's
samples where it is pending (asynchronous scheduling).

In torch that is three launches before the graph replays (the samples gathered, scattered into input_ids,
then the embedding rows gathered), each some 2-3.5 us at batch 1 on an H200; on CUDA one Triton kernel
does it all: a program per token row looks its row up among the pending ones, reads its id, writes it back
into input_ids and copies the embedding row.

Triton on CUDA tensors (common/kernels/embed_rows.py); the torch ops elsewhere (and under
TRITON_INTERPRET=1 tests call the kernel through `triton_embed_rows`).
"""

from __future__ import annotations

import torch


def embed_rows(out: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
               pending: tuple[torch.Tensor, torch.Tensor] | None, last_tokens: torch.Tensor | None) -> None:
    """out[i] = weight[input_ids[i]] for every row, after input_ids[pending_rows[j]] =
    last_tokens[pending_samples[j]] (pending = (pending_rows, pending_samples), or None)."""
    if out.shape != (input_ids.shape[0], weight.shape[1]):
        raise ValueError(f"out must be [{input_ids.shape[0]}, {weight.shape[1]}], got {tuple(out.shape)}")
    if pending is not None and last_tokens is None:
        raise ValueError("pending rows need the last step's sampled tokens")
    if out.is_cuda:
        triton_embed_rows(out, weight, input_ids, pending, last_tokens)
        return
    fill_pending(input_ids, pending, last_tokens)
    torch.index_select(weight, 0, input_ids, out=out)


def fill_pending(input_ids: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None,
                 last_tokens: torch.Tensor | None) -> None:
    """input_ids[pending_rows[j]] = last_tokens[pending_samples[j]] (nothing when pending is None)."""
    if pending is not None:
        rows, samples = pending
        input_ids.index_copy_(0, rows, last_tokens.index_select(0, samples))


def triton_embed_rows(out: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                      pending: tuple[torch.Tensor, torch.Tensor] | None,
                      last_tokens: torch.Tensor | None) -> None:
    """embed_rows through the Triton kernel (a CUDA tensor, or any under TRITON_INTERPRET=1)."""
    from common.kernels import embed_rows as kernel

    kernel.embed_rows(out, weight, input_ids, pending, last_tokens)
