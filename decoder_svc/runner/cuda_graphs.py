"""CUDA graphs for small steps.

A step of a 7B model launches a few hundred small kernels; when the step computes few tokens, the
host's launch cost exceeds the GPU's work. Replaying a captured graph removes it. Two families:

- plain decode (one text token per sequence), keyed by the number of sequences: 1, 2, 4, 8, then steps
  of 8 up to 64 and of 16 beyond, up to max_num_seqs; attention takes its decode shape (16-row tiles,
  keys split across programs when there are few sequences);
- any other step of at most 512 tokens (a prefill chunk after a prefix-cache hit, a short prompt,
  decodes mixed with a small chunk), keyed by the number of tokens: 16, 32, ... 512. Padding tokens
  are one-token sequences with no context; unused sequence slots are empty. A hybrid stack (linear-
  attention layers with state slots) has its decode graphs' state slots as an input buffer like the block
  tables (the runner's `state_slots`); it has these other graphs only where its linear layers run a
  graph's rows (model/linear_state.py's LinearGraphRows), for steps whose sequences are all short.

Graphs take input embeddings (the runner embeds and fuses image rows into the static buffer first), so
steps with image rows replay too; a model whose image rows carry DeepStack levels (Qwen3-VL) has its
other steps' graphs twice, the second set adding a static buffer of levels (zero off the image rows)
after the first layers, for the steps with image rows, so that a text step's graph computes as it always
did. A model with LoRA adapters has each graph twice: with the batched LoRA product, and without it for
steps where no row has an adapter (those keep the one-row kernels that fuse a norm or the activation into
the product, and launch no LoRA kernels); a model with an adapter merged at load (model/lora/merged.py)
has a third set, over the merged copies of the projections, for steps whose rows all run that adapter: a
graph holds its weights' addresses, so the choice is a graph of its own. They are captured largest first
so that every smaller graph fits in the memory pool the first one reserved.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from decoder_svc.model.attention import AttentionBackend
from decoder_svc.model.linear_state import LinearStateStep
from decoder_svc.runner.piecewise_graphs import PiecewiseGraph

MAX_GRAPH_TOKENS = 512


@dataclass(frozen=True)
class GraphKey:
    """Which graph: plain decode over `size` sequences, or any step of up to `size` tokens; `lora`: with
    the LoRA product (some row has an adapter); `merged`: over the merged adapter's weights (every row
    runs it; never with `lora`); `deepstack`: a step with DeepStack image rows (never a decode graph),
    their levels added after the first layers from a buffer of the runner's."""

    decode: bool
    size: int
    lora: bool = False
    merged: bool = False
    deepstack: bool = False
    piecewise: bool = False  # a hybrid stack's prefill step: pieces between its layers' mixing

    @property
    def num_tokens(self) -> int:
        """Token rows the graph computes."""
        return self.size

    @property
    def num_seqs(self) -> int:
        """Sequence slots the graph's attention metadata has (padding included)."""
        return self.size


def decode_sizes(max_num_seqs: int) -> list[int]:
    """Sequence counts of the decode graphs, ascending; the last one is max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 16
    sizes.append(max_num_seqs)
    return sizes


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of a hybrid stack's piecewise graphs, ascending: from 128 (shorter steps are the mixed
    graphs' or eager) doubling until one holds the step budget."""
    sizes = [128]
    while sizes[-1] < max_num_batched_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the graphs for other small steps, ascending."""
    sizes, size = [16], 16
    while size < min(MAX_GRAPH_TOKENS, max_num_batched_tokens):
        size *= 2
        sizes.append(size)
    return sizes


class StepGraphs:
    """Captured graphs and their output logits, by key."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, lora: bool = False,
                 merged: bool = False, decode_only: bool = False, deepstack: bool = False,
                 piecewise: bool = False) -> None:
        """`lora`: the model has adapters (graphs with the LoRA product too); `merged`: one of them is
        merged (graphs over its merged weights too); `decode_only`: no graphs for other steps (a hybrid
        stack whose linear layers cannot run a graph's rows); `deepstack`: its image rows carry DeepStack
        levels (the other steps' graphs again, with them: a text step's graph stays as it was);
        `piecewise`: a hybrid stack's longer prefill steps too, as piecewise graphs (piecewise_graphs.py)."""
        self.decode_sizes = decode_sizes(max_num_seqs)
        self.mixed_sizes = [] if decode_only else mixed_sizes(max_num_batched_tokens)
        kinds = [(False, False)] + [(True, False)] * lora + [(False, True)] * merged
        self.keys = [GraphKey(True, s, a, m) for a, m in kinds for s in self.decode_sizes]
        self.keys += [GraphKey(False, s, a, m, d) for d in (False, True)[:1 + deepstack] for a, m in kinds
                      for s in self.mixed_sizes]
        self.piecewise_sizes = piecewise_sizes(max_num_batched_tokens) if piecewise else []
        self.keys += [GraphKey(False, s, piecewise=True) for s in self.piecewise_sizes]
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor] | PiecewiseGraph] = {}
        self.memory_bytes = 0

    @staticmethod
    def available(device: torch.device, backend: AttentionBackend) -> bool:
        """Graphs need a CUDA device and an attention backend that never synchronises with the host."""
        return device.type == "cuda" and backend.supports_cuda_graphs

    @property
    def max_tokens(self) -> int:
        """The most token rows any graph computes (the runner sizes its buffers to hold them)."""
        return max(k.num_tokens for k in self.keys)

    def key_for(self, num_seqs: int, num_tokens: int, plain_decode: bool, lora: bool = False,
                merged: bool = False, deepstack: bool = False, piecewise: bool = False) -> GraphKey | None:
        """The smallest captured graph that can run this step, or None (run it eagerly). `lora`: some row
        of the step has an adapter; `merged`: every row runs the merged one (its weights, no product);
        `deepstack`: the step has image rows with DeepStack levels; `piecewise`: a hybrid stack's step
        that only a piecewise graph runs."""
        if piecewise:
            i = bisect.bisect_left(self.piecewise_sizes, num_tokens)
            key = GraphKey(False, self.piecewise_sizes[i], piecewise=True) if i < len(self.piecewise_sizes) \
                else None
            return key if key in self._graphs else None
        if plain_decode and not deepstack:
            i = bisect.bisect_left(self.decode_sizes, num_seqs)
            key = GraphKey(True, self.decode_sizes[i], lora, merged) if i < len(self.decode_sizes) else None
            if key in self._graphs:
                return key
        i = bisect.bisect_left(self.mixed_sizes, num_tokens)
        key = (GraphKey(False, self.mixed_sizes[i], lora, merged, deepstack) if i < len(self.mixed_sizes)
               else None)
        return key if key in self._graphs else None

    def capture(self, run: Callable[..., torch.Tensor], progress: bool = True,
                mix_out: torch.Tensor | None = None) -> None:
        """Capture run(key) (the model over the runner's static buffers) for every key; a piecewise key's
        as run(key, break) in pieces, each mixing's output copied into mix_out at a replay."""
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        keys = sorted(self.keys, key=lambda k: (-k.num_tokens, k.decode))
        for key in tqdm(keys, desc="capturing CUDA graphs", disable=not progress, leave=False):
            run(key)  # warm-up: compiles kernels and creates library handles outside the capture
            torch.cuda.synchronize()
            if key.piecewise:
                pieces = PiecewiseGraph(mix_out)
                pool = pieces.capture(lambda cut, key=key: run(key, cut), pool)
                self._graphs[key] = pieces
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run(key)
            pool = graph.pool()
            self._graphs[key] = (graph, out)
        torch.cuda.synchronize()
        self.memory_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)

    def replay(self, key: GraphKey, linear_state: LinearStateStep | None = None, rows: int = 0
               ) -> torch.Tensor:
        """Replay a graph; returns its (static) logits. A piecewise graph's mixings run over the live
        step's `linear_state`, its first `rows` rows (the step's own, before the padding) kept."""
        if key.piecewise:
            return self._graphs[key].replay(linear_state, rows)
        graph, out = self._graphs[key]
        graph.replay()
        return out
