"""CUDA graphs of the vision tower + projector at bucketed batch sizes.

At small batches the tower is bound by kernel launches from Python (CLIP-L/336: ~300 launches a
forward), not by the GPU: a graph replays them in one call. Each bucket (1, 2, 4, ... up to the largest
batch) has a static input and output; a batch of n images runs in the smallest bucket >= n (the padding
rows are computed and dropped: images never interact in the tower). Larger batches run eagerly.

The static buffers are shared by every replay, so one graph set may be replayed on one stream only:
the worker uses it for demand batches (their stream); prefetch batches run eagerly on theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


def capture_tower_graphs(fn: Callable[[torch.Tensor], torch.Tensor], sample_shape: Sequence[int],
                         dtype: torch.dtype, device: torch.device, max_batch: int,
                         what: str) -> GraphedForward | None:
    """GraphedForward of a tower's fn at bucket_sizes(max_batch), or None (logged: the tower then runs
    eagerly) when capturing fails; `what` names the tower in the log."""
    try:
        graphs = GraphedForward(fn, sample_shape, dtype, device, bucket_sizes(max_batch))
    except Exception as exc:  # noqa: BLE001 - a tower that cannot be captured still runs eagerly
        log.warning("CUDA graph capture of the %s failed, running eagerly: %s", what, exc)
        return None
    log.info("%s CUDA graphs captured for batches %s", what, graphs.buckets)
    return graphs


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    sizes = []
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


class GraphedForward:
    """`fn(pixels)` replayed from CUDA graphs captured at `batch_sizes` (input [b, *sample_shape])."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], sample_shape: Sequence[int],
                 dtype: torch.dtype, device: torch.device, batch_sizes: Sequence[int]) -> None:
        self.fn = fn
        self.buckets = sorted(set(batch_sizes))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        pool = None
        with torch.cuda.stream(side), torch.inference_mode():
            for b in reversed(self.buckets):  # the largest first: later graphs fit in its memory pool
                static_in = torch.zeros((b, *sample_shape), dtype=dtype, device=device)
                for _ in range(2):  # outside the capture: lazy inits, cuBLAS workspaces, autotuning
                    fn(static_in)
                side.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    static_out = fn(static_in)
                pool = graph.pool()
                self._graphs[b] = (graph, static_in, static_out)
        torch.cuda.current_stream(device).wait_stream(side)

    def bucket(self, n: int) -> int | None:
        """The bucket a batch of n images runs in; None when n is past the largest (eager)."""
        return next((b for b in self.buckets if b >= n), None)

    def __len__(self) -> int:
        """Graphs captured."""
        return len(self._graphs)

    def batch_size(self, waiting: int) -> int:
        """How many of `waiting` images (at most the largest bucket) to run now: all of them, unless
        padding them to their bucket would waste more than a quarter of it (17 images would run as 32);
        then the largest bucket they fill (16), and the rest go with the next batch."""
        b = self.bucket(waiting)
        if b is None or 4 * (b - waiting) <= b:
            return waiting
        return max(size for size in self.buckets if size <= waiting)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """fn(pixels), from a graph when a bucket fits (on the caller's current stream)."""
        b = self.bucket(pixels.shape[0])
        if b is None:
            return self.fn(pixels)
        graph, static_in, static_out = self._graphs[b]
        if pixels.shape[1:] != static_in.shape[1:] or pixels.dtype != static_in.dtype:
            return self.fn(pixels)  # not the captured image shape: eager
        n = pixels.shape[0]
        static_in[:n].copy_(pixels)
        graph.replay()
        # a copy: the next replay overwrites static_out, and callers may keep the result
        return static_out[:n].clone()
