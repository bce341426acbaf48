"""Giving freed heap memory back to the system after large jobs (glibc's malloc_trim), and keeping it
between requests (glibc's mallopt).

glibc keeps freed blocks in its arenas instead of returning them, and raises its mmap threshold after a
large block is freed, so a process that once decoded a 4096x4096 image or a 1080p video's frames stays
that large. The decoder calls this after each request's inputs (decoder_svc/engine/input_processor.py); the
encoder after each video it decodes and in its image-decode processes after
large images. A call is cheap next to the jobs it follows (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load_glibc(name: str, argtypes: list) -> Callable[..., int] | None:
    """A glibc function, or None where the C library is another (musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_MALLOC_TRIM = _load_glibc("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _load_glibc("mallopt", [ctypes.c_int, ctypes.c_int])
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)

# Blocks up to this size (request messages, image files and their pixels) come from the heap, and up to
# this much freed memory stays at the top of an arena before glibc gives it back.
HEAP_BLOCK_BYTES = 32 << 20

# A job that took this much (a 4096x4096 image is 48 MiB of pixels) is worth a trim after it; a trim walks
# every arena, so small jobs go without.
LARGE_JOB_BYTES = 32 << 20


def reuse_freed_blocks() -> bool:
    """Keep megabyte blocks on the heap for the next request (once per process, at start-up); False where
    there is no mallopt.

    By default glibc maps fresh pages for each block past its adaptive threshold (a few MB, after the
    first one is freed) and trims the heap's top past twice that, so every request of a few MB pays
    page faults for each copy of its bytes (docs/benchmarks/history.md, "Page faults on every request's
    bytes", measured with bench/grpc_floor.py's server). What this keeps is bounded by HEAP_BLOCK_BYTES per
    arena's top, and `release_freed_memory` still returns it after large jobs.
    """
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and bool(
        _MALLOPT(_M_TRIM_THRESHOLD, HEAP_BLOCK_BYTES))


def release_freed_memory() -> bool:
    """Return memory freed since the last call to the system where glibc kept it; False where there is
    no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
