"""A check shared by the GPU tests of early-launched kernels (pdl.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_replays_as_eager(chain: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                            new_input: Callable[[float], torch.Tensor]) -> None:
    """Capture chain(x) in a CUDA graph (after one eager call: compiles and autotunes outside the
    capture), then for a few new inputs written into x: the replay gives the eager call's bits. A kernel
    launched early that read its input before the kernel writing it had finished would differ."""
    chain(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for scale in (0.5, -2.0, 3.0):
        x.copy_(new_input(scale))
        want = chain(x.clone())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
