"""CUDA graphs for decode-only steps.

A decode step of a 7B model launches a few hundred small kernels; replaying them from a graph removes the
host's launch cost, which otherwise dominates at small batches. Graphs are captured once per bucket batch
size (1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond), largest first so that every smaller graph
fits in the memory pool the first one reserved; a step with n sequences replays the smallest bucket >= n
with the rest padded (padded rows store no K/V and attend to nothing).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from tqdm import tqdm


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending; the last one is max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 16
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode graphs and their output tensors, by bucket size."""

    def __init__(self, max_num_seqs: int) -> None:
        self.sizes = bucket_sizes(max_num_seqs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs sequences, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self._graphs else None

    def capture(self, run: Callable[[int], torch.Tensor], progress: bool = True) -> None:
        """Capture run(batch_size) (the model over the runner's static buffers) at every bucket size."""
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        sizes = sorted(self.sizes, reverse=True)
        for size in tqdm(sizes, desc="capturing decode CUDA graphs", disable=not progress, leave=False):
            run(size)  # warm-up: compiles kernels and creates library handles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run(size)
            pool = graph.pool()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.memory_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of a bucket size; returns its (static) logits [size, vocab]."""
        graph, out = self._graphs[size]
        graph.replay()
        return out
