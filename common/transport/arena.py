"""An embedding arena: one big buffer, exported once, carved into (offset, nbytes) slices.

The allocator is first-fit over a sorted free list with coalescing. Slices are aligned (256 bytes, the
CUDA allocation granularity for coalesced access) so every entry starts on a boundary any dtype view
accepts. The allocator does no eviction: the cache decides what to free when `alloc` returns None.
"""

from __future__ import annotations

import bisect
import threading
from abc import ABC, abstractmethod

import torch

ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """n rounded up to a multiple of alignment."""
    return (n + alignment - 1) // alignment * alignment


class SliceAllocator:
    """First-fit allocator of aligned (offset, nbytes) slices inside [0, capacity). Thread-safe."""

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if capacity <= 0:
            raise ValueError("arena capacity must be positive")
        self.capacity = capacity // alignment * alignment
        self.alignment = alignment
        self._free_starts: list[int] = [0]  # sorted starts of free runs
        self._free_len: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}  # offset -> reserved (aligned) size
        self._lock = threading.Lock()

    @property
    def bytes_reserved(self) -> int:
        """Bytes held by live slices (aligned sizes)."""
        with self._lock:
            return sum(self._used.values())

    def reserved_size(self, nbytes: int) -> int:
        """The aligned size a slice of nbytes takes."""
        return align_up(max(nbytes, 1), self.alignment)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new slice of nbytes, or None when no free run is large enough."""
        size = self.reserved_size(nbytes)
        with self._lock:
            for i, start in enumerate(self._free_starts):
                run = self._free_len[start]
                if run >= size:
                    del self._free_starts[i]
                    del self._free_len[start]
                    if run > size:
                        bisect.insort(self._free_starts, start + size)
                        self._free_len[start + size] = run - size
                    self._used[start] = size
                    return start
        return None

    def free(self, offset: int) -> None:
        """Return a slice; neighbouring free runs merge. Freeing an unknown offset raises KeyError."""
        with self._lock:
            size = self._used.pop(offset)
            start, end = offset, offset + size
            i = bisect.bisect_left(self._free_starts, start)
            if i < len(self._free_starts) and self._free_starts[i] == end:  # merge the run after
                end += self._free_len.pop(end)
                del self._free_starts[i]
            if i > 0:  # merge the run before
                prev = self._free_starts[i - 1]
                if prev + self._free_len[prev] == start:
                    start = prev
                    del self._free_starts[i - 1]
                    del self._free_len[prev]
            bisect.insort(self._free_starts, start)
            self._free_len[start] = end - start

    def largest_free(self) -> int:
        """Size of the largest free run."""
        with self._lock:
            return max(self._free_len.values(), default=0)


class Arena(ABC):
    """One exported buffer that the cache stores embeddings in."""

    capacity: int
    device: torch.device
    _buf: torch.Tensor | None  # the whole buffer as uint8, set by each kind of arena

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor aliasing [offset, offset + nbytes) of the buffer (no copy)."""
        if offset + nbytes > self.capacity:
            raise ValueError("slice past the end of the arena")
        return self._buf[offset:offset + nbytes]

    @abstractmethod
    def close(self) -> None:
        """Release the buffer (producers only)."""

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy a contiguous tensor's bytes into the slice at offset (on the current stream on CUDA)."""
        src = tensor.contiguous().view(-1).view(torch.uint8)
        self.view(offset, src.numel()).copy_(src, non_blocking=True)


class TensorArena(Arena):
    """A private arena in one torch tensor: no export, so only the inline transport can serve it.

    Used where neither shared memory nor cupy is available.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.device = torch.device(device)
        self._buf = torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)
