"""Piecewise CUDA graphs for a hybrid stack's prefill steps: the forward captured in pieces that end where
a linear layer's token mixing begins, the mixing itself run eagerly between them.

A hybrid stack's prefill step of a thousand tokens is host-bound: its GPU work is about that of a plain
stack's, but every layer launches its own kernels from Python, and the linear layers' token mixing (the
convolution, fla's chunked rule over the step's pieces, the state and snapshot writes) has shapes and
indices that follow the step's chunks, which a graph cannot hold. Everything else (norms, projections,
gates, the gated norm, MLPs, the attention layers over the runner's static metadata) has the shape of the
step's token count alone. So a graph of T rows is captured as pieces: piece i runs from the end of layer
i - 1's mixing to the start of layer i's; between two pieces the replay calls the mixing of that layer,
bound to the projected rows piece i left in the graph's memory, with the live step's chunks, and copies
its output into one static tensor that the next piece reads (vLLM's piecewise graphs split at attention
the same way, for the same reason).

The capture runs the forward once with a break at every mixing: the break ends the current piece's
capture, records the mixing, and starts the next piece. Nothing runs at a break during the capture (the
pieces' kernels are recorded, not run, so their outputs hold no values yet); the warm-up forward before
it runs every mixing eagerly. A CPU has no CUDA graphs: `live_break` runs the forward with every mixing
in place as a replay does (tests' emulation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decoder_svc.model.linear_state import LinearStateStep, Mix

Break = Callable[[Mix, int], torch.Tensor]


def mix_into(out: torch.Tensor, mix: Mix, step: LinearStateStep, rows: int) -> None:
    """Run a mixing over the live `step`, its first `rows` rows (the step's own) into the static `out`:
    what a replay does between two pieces, and what `live_break` does in its place."""
    out[:rows].copy_(mix(step)[:rows])


def live_break(out: torch.Tensor, step: LinearStateStep, rows: int) -> Break:
    """A break that runs each mixing as a replay does (`mix_into`): out's view of the mixing's shape is
    what the layer reads."""

    def run(mix: Mix, num_rows: int) -> torch.Tensor:
        mix_into(out, mix, step, rows)
        return out[:num_rows]

    return run


class PiecewiseGraph:
    """The pieces of one captured forward and the mixings between them."""

    def __init__(self, out: torch.Tensor) -> None:
        """out: the static tensor [rows >= the graph's, Hv, Dv] every mixing's output is copied into."""
        self.out = out
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.mixes: list[Mix] = []
        self.logits: torch.Tensor | None = None

    def capture(self, run: Callable[[Break], torch.Tensor], pool: tuple | None) -> tuple:
        """Capture run(break) (the model over the runner's static buffers, a break at each mixing) as
        pieces, in the memory pool `pool` (None: a new one); returns the pool."""
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()  # a capture runs on a side stream (as torch.cuda.graph's does)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            piece = self._begin(pool)

            def cut(mix: Mix, num_rows: int) -> torch.Tensor:
                nonlocal piece, pool
                piece.capture_end()
                pool = piece.pool()
                self.pieces.append(piece)
                self.mixes.append(mix)
                piece = self._begin(pool)
                return self.out[:num_rows]

            self.logits = run(cut)
            piece.capture_end()
            self.pieces.append(piece)
        torch.cuda.current_stream().wait_stream(stream)
        return piece.pool()

    @staticmethod
    def _begin(pool: tuple | None) -> torch.cuda.CUDAGraph:
        piece = torch.cuda.CUDAGraph()
        piece.capture_begin(pool=pool)  # None: a pool of its own, which the later pieces then share
        return piece

    def replay(self, step: LinearStateStep, rows: int) -> torch.Tensor:
        """Replay the pieces, each layer's mixing over `step` between them (its first `rows` rows copied
        into the static output); returns the graph's static logits."""
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.mixes):
                mix_into(self.out, self.mixes[i], step, rows)
        return self.logits
