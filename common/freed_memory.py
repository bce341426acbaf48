"""Giving freed heap memory back to the system after large jobs (glibc's malloc_trim).

glibc keeps freed blocks in its arenas instead of returning them, and raises its mmap threshold after a
large block is freed, so a process that once decoded a 4096x4096 image or a 1080p video's frames stays
that large. The decoder calls this after each request's inputs (decoder_svc/engine/input_processor.py); the
encoder after each video it decodes and in its image-decode processes after
large images. One call took about 0.1 ms here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()

# A job that took this much (a 4096x4096 image is 48 MiB of pixels) is worth a trim after it; a trim walks
# every arena, so small jobs go without.
LARGE_JOB_BYTES = 32 << 20


def release_freed_memory() -> bool:
    """Return memory freed since the last call to the system where glibc kept it; False where there is
    no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
