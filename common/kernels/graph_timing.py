"""Timing GPU calls as decode runs them: captured back to back in one CUDA graph and replayed, over
enough copies of the weights that none is read from L2; or eagerly between CUDA events, as long
prefills run. The start-up choices between kernels (stream_gemv.choose, the decoder's fused-GEMV choice,
the MoE tilings, moe_tuning.py) and the benchmarks use it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def copy_count(nbytes: int, device: torch.device) -> int:
    """How many copies of nbytes of weights (the original included, 1-8) a timing rotates over so that
    every one streams from memory, as a decode step does (one weight alone may fit in L2 and time faster
    than it ever runs): together at least 3x L2."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return min(max(-(-3 * l2 // max(nbytes, 1)), 1), 8)


def graph_time_us(calls: list[Callable[[], object]], replays: int = 10, rounds: int = 5) -> float:
    """Microseconds per call of `calls` captured back to back in one CUDA graph and replayed (the best
    of `rounds` timings of `replays` replays). Each call runs once first: kernels compile and tune
    outside the capture."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    del graph
    return best


def event_time_us(calls: list[Callable[[], object]], rounds: int = 5) -> float:
    """Microseconds per call of `calls` launched eagerly back to back between two CUDA events (the median
    of `rounds`), as long prefills run outside graphs. Each call runs once first."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]
