"""fla's varlen chunk indices given ahead, so that a chunked call does not stop the host.

fla-core 0.4's chunked kernels find each sequence's 64-token chunks from `cu_seqlens` through two helpers,
`prepare_chunk_indices` and `prepare_chunk_offsets`, which read the lengths back to the host (`.tolist()`: a
synchronisation with the GPU) and cache one result only, keyed by the identity of the `cu_seqlens` tensor.
A prefill step cut at snapshot positions calls the rule once per round with another `cu_seqlens` each
time, layer after layer, so each call missed that cache and the host waited for the GPU to drain its
queue, twice per call.

The step knows its pieces' lengths on the host already. `seed` computes both helpers' results from those
lengths and hands them to the device with the step's other indices (no read-back); `install` points fla's
modules at wrappers that return a seeded result for a `cu_seqlens` tensor seeded (by identity) and call
fla's own helper otherwise. The results are fla's exactly (tests/qwen3_5/test_fla_indices.py compares
them with fla's formulas).
"""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict
from collections.abc import Callable

import torch

HELPERS = ("prepare_chunk_indices", "prepare_chunk_offsets")
_KEEP = 64  # seeded cu_seqlens tensors remembered (a few steps' rounds)
_seeded: OrderedDict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def chunk_indices(lengths: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """(sequence, chunk within it) of every chunk of the packed sequences: prepare_chunk_indices's rows."""
    return [(i, j) for i, n in enumerate(lengths) for j in range(-(-n // chunk_size))]


def chunk_offsets(lengths: list[int], chunk_size: int) -> list[int]:
    """Where each sequence's chunks start among all chunks, and their total: prepare_chunk_offsets."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + -(-n // chunk_size))
    return offsets


def seed(cu_seqlens: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, chunk_size: int) -> None:
    """Remember the helpers' results for this cu_seqlens tensor (indices [chunks, 2], offsets [N + 1], both
    on its device, as chunk_indices / chunk_offsets give them)."""
    for name, value in zip(HELPERS, (indices, offsets), strict=True):
        key = (id(cu_seqlens), chunk_size, name)
        _seeded[key] = (cu_seqlens, value)  # the tensor is held: its id is not reused while seeded
        _seeded.move_to_end(key)
    while len(_seeded) > _KEEP * len(HELPERS):
        _seeded.popitem(last=False)


def _seeded_or(name: str, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def helper(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        hit = _seeded.get((id(cu_seqlens), chunk_size, name))
        if hit is not None and hit[0] is cu_seqlens:
            return hit[1]
        return original(cu_seqlens, chunk_size)

    helper.seeded_wrapper = True
    return helper


def install(prefix: str = "fla.") -> int:
    """Point every imported module under `prefix` that holds fla's helpers at the seeded wrappers (once:
    a module already pointed is left). Returns how many names were replaced."""
    modules = [m for name, m in list(sys.modules.items()) if name.startswith(prefix) and m is not None]
    replaced = 0
    for name in HELPERS:
        originals = {id(f): f for m in modules if callable(f := getattr(m, name, None))
                     and not getattr(f, "seeded_wrapper", False)}
        for original in originals.values():
            wrapper = _seeded_or(name, original)
            for module in modules:
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
                    replaced += 1
    return replaced
