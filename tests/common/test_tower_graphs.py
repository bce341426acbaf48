"""The vision tower's graph cache (common/vision/tower_graphs.py) on CPU: its bookkeeping only, with
torch.cuda replaced by stand-ins that run the captured forward eagerly."""

from __future__ import annotations

import contextlib
import types

import torch

from common.vision import tower_graphs
from common.vision.tower_graphs import SignatureGraphs


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _Graph:
    def replay(self) -> None:
        pass


def _fake_cuda() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        current_stream=lambda device=None: _Stream(), Stream=lambda device=None: _Stream(),
        stream=lambda s: contextlib.nullcontext(), CUDAGraph=_Graph, graph_pool_handle=object,
        graph=lambda *a, **k: contextlib.nullcontext())


class _Tower(torch.nn.Module):
    flash_attention = True

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = types.SimpleNamespace(proj=torch.nn.Linear(4, 4))

    def plan(self, grids, device, dtype):
        return grids

    def run(self, pixels, plan):
        return pixels * 2

    def forward(self, pixels, grids):
        return pixels * 2


def _pixels(rows: int) -> torch.Tensor:
    return torch.ones(rows, 4)


def test_the_least_recently_replayed_graph_goes_first(monkeypatch):
    monkeypatch.setattr(tower_graphs, "torch", types.SimpleNamespace(cuda=_fake_cuda(), Tensor=torch.Tensor))
    graphs = SignatureGraphs(_Tower(), capture_after=1, max_graphs=2)
    a, b, c = [(1, 1, 1)], [(1, 1, 2)], [(1, 2, 1)]
    for grids, rows in ((a, 1), (b, 2), (a, 1)):  # a captured, b captured, a replayed: b is least recent
        graphs(_pixels(rows), grids)
    assert graphs.replays == 3
    graphs(_pixels(3), c)  # a fourth capture over the limit of two
    kept = [key[0] for key in graphs.graphs]
    assert kept == [tuple(a), tuple(c)] and len(graphs) == 2
