"""CUDA graphs of a Qwen vision tower, one per batch signature (the tuple of the batch's grids).

A Qwen tower's launches depend on the batch: its sequence length, its spans, its window order. Python
launches about 400 kernels a forward (12-14 per block), which on a busy host can take as long as the
GPU's work for one large image (BENCHMARKS.md, "Figures from the code's docstrings").
Images of a service repeat sizes (a camera, a screenshot tool, a client that resizes), so a signature
seen `capture_after` times is captured once with its plan (QwenVisionTower.plan: every index and table
already on the device) and replayed from then on: one launch. Signatures stay exact (no padding), so a
replay computes exactly what the eager forward computes.

Graphs share one memory pool and one set of static inputs per signature; they are replayed on one
stream only (the encoder's demand stream: VisionWorker passes `use_graphs` for demand batches), in any
order. At most `max_graphs` are kept (least recently used go, after the device is idle), and only
batches of at most `max_patches` patches are captured (a large batch amortises its launches anyway,
and its activations would stay reserved in the pool).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.vision.attention import attention_kernel

log = logging.getLogger(__name__)

Grid = tuple[int, int, int]
SEEN_SIGNATURES = 4096  # signatures whose sightings are counted (least recently seen forgotten first)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: Any  # the tower's output: a tensor, or Qwen3VisionFeatures
    plan: Any


def _clone(out: Any) -> Any:
    """A copy of a captured output (the next replay overwrites the static one)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(out.merged.clone(), tuple(t.clone() for t in out.deepstack))


class SignatureGraphs:
    """`tower(pixels, grids)`, replayed from a CUDA graph once the batch's signature has been seen
    `capture_after` times. tower: a QwenVisionTower or Qwen3VisionTower (its `plan` and `run`)."""

    def __init__(self, tower: torch.nn.Module, capture_after: int = 2, max_graphs: int = 16,
                 max_patches: int = 20480) -> None:
        self.tower = tower
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.max_patches = max_patches
        self.seen: OrderedDict[tuple, int] = OrderedDict()  # sightings of recent signatures, bounded
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.failed: set[tuple] = set()
        self.replays = 0
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # every capture's (see _capture)

    def __len__(self) -> int:
        """Graphs kept now (at most max_graphs)."""
        return len(self.graphs)

    def batch_size(self, waiting: int) -> int:
        """How many waiting images a demand batch takes: all (signatures are exact, nothing is padded)."""
        return waiting

    def __call__(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> Any:
        key = (tuple(tuple(int(x) for x in g) for g in grids), pixels.dtype, pixels.shape[1],
               bool(getattr(self.tower, "flash_attention", True)), attention_kernel())
        captured = self.graphs.get(key)
        if captured is None:
            self.seen[key] = self.seen.pop(key, 0) + 1
            while len(self.seen) > SEEN_SIGNATURES:  # a stream of ragged batches: each signature is new
                self.seen.popitem(last=False)
            if (self.seen[key] < self.capture_after or key in self.failed
                    or pixels.shape[0] > self.max_patches):
                return self.tower(pixels, grids)
            captured = self._capture(key, pixels, grids)
            if captured is None:
                return self.tower(pixels, grids)
        self.graphs.move_to_end(key)
        captured.static_in.copy_(pixels)
        captured.graph.replay()
        self.replays += 1
        return _clone(captured.static_out)

    def _capture(self, key: tuple, pixels: torch.Tensor, grids: Sequence[Grid]) -> _Captured | None:
        device = pixels.device
        dtype = self.tower.patch_embed.proj.weight.dtype
        if len(self.graphs) >= self.max_graphs:
            torch.cuda.current_stream(device).synchronize()  # the oldest graph's memory may be in use
            self.graphs.popitem(last=False)
        current = torch.cuda.current_stream(device)
        # Captured off the caller's stream (which may be the default one), always on this one stream:
        # torch's allocator keeps freed blocks per stream, so the warm-up's activations on a new stream
        # for each capture (a pool of 32) stayed reserved per stream, growing the encoder by gigabytes.
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        side = self.stream
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                plan = self.tower.plan(grids, device, dtype)
                static_in = pixels.clone()
                self.tower.run(static_in, plan)  # warm-up: lazy inits, attention choices (they sync)
                side.synchronize()
                graph = torch.cuda.CUDAGraph()
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                    static_out = self.tower.run(static_in, plan)
        except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: this signature runs eagerly
            log.warning("CUDA graph capture of the vision tower failed for %s; eager: %s", key[0], exc)
            self.failed.add(key)
            return None
        finally:
            current.wait_stream(side)
        captured = _Captured(graph, static_in, static_out, plan)
        self.graphs[key] = captured
        log.info("captured a CUDA graph of the vision tower for grids %s (%d kept)", key[0], len(self.graphs))
        return captured
