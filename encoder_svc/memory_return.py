"""Giving host memory back after large tower inputs (issue 38: the encoder kept its peak RSS) and after
bursts of image requests (issue 67: a flood of distinct 1344x1344 images left the encoders +8-11%).

A 4096x4096 image is 48 MiB of pixels and, prepared for Qwen2.5-VL, 300 MB of fp32 patch rows; the
tower's activations for its 16384 tokens come on top. glibc keeps such freed blocks (common/
freed_memory.py), so without a trim the encoder stays as large as its largest batch. A trim walks every
arena, so it runs only after a batch whose inputs reach LARGE_JOB_BYTES, not after every small one.

That trim comes before the request's own bytes (its message, the decoded pixels in the prep threads) are
let go, so the Encodes' bytes are also counted as they end (`EncodeBytes`, common/memory_return.py: a
trim once enough went by, and once a burst is over). And glibc gives each thread that allocates an arena
of its own (up to 8 per core); freed memory spread over a dozen threads' arenas did not come back with a
trim, while over MALLOC_ARENAS it did (bench/experiments/encoder_flood_rss.py), so the encoder process
starts with that limit (`limit_malloc_arenas`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.freed_memory import LARGE_JOB_BYTES, release_freed_memory
from common.memory_return import MemoryReturn

# An Encode of this many message bytes or more counts towards the next trim (an image file of tens of KB).
HEAVY_ENCODE_BYTES = 64 << 10
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def input_nbytes(prepared: object) -> int:
    """Host bytes of one prepared tower input: a tensor, or the tensors of a Qwen-VL prepared input."""
    if isinstance(prepared, torch.Tensor):
        return prepared.numel() * prepared.element_size()
    parts = (getattr(prepared, "pixel_values", None), getattr(prepared, "raw", None),
             getattr(prepared, "frames", None))
    return sum(input_nbytes(t) for t in parts if t is not None)


def return_memory_after(nbytes: int) -> bool:
    """Give freed memory back to the system after a batch whose inputs took `nbytes` (once they are
    dropped), when that was large; True when it did."""
    return nbytes >= LARGE_JOB_BYTES and release_freed_memory()


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let glibc make at most `arenas` malloc arenas in this process, unless $MALLOC_ARENA_MAX already
    says how many; call it at start-up, before threads allocate (arenas already made stay). True when it
    set the limit."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


@dataclass
class EncodeBytes:
    """The Encodes of HEAVY_ENCODE_BYTES or more in flight; each one's bytes counted towards a trim as it
    ends (MemoryReturn: once 16 MiB went by, or when the last one in flight ends). Used on the servicer's
    event loop only."""

    memory: MemoryReturn = field(default_factory=MemoryReturn)
    heavy_open: int = 0

    @contextlib.contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """Around one Encode whose message is nbytes."""
        heavy = nbytes >= HEAVY_ENCODE_BYTES
        self.heavy_open += heavy
        try:
            yield
        finally:
            if heavy:
                self.heavy_open -= 1
                self.memory.freed(nbytes, idle=self.heavy_open == 0)
