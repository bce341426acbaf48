"""Memory given back to the system after large requests.

A fetched image is a Python bytes object; a large one is freed into glibc's heap, which keeps it rather
than returning it, so the gateway's RSS would stay at the peak of its largest burst. glibc's
malloc_trim returns it (the decoder does the same after large image requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable

# After the request's handler has returned and its objects are garbage: a moment later, not at once.
TRIM_DELAY_S = 1.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is another (musl, macOS)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()
_scheduled = False


def return_freed_memory() -> None:
    """Return the heap's free memory to the system now (nothing where the C library is not glibc)."""
    global _scheduled
    _scheduled = False
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def return_freed_memory_soon() -> None:
    """return_freed_memory() once, TRIM_DELAY_S from now, on the running event loop (if any)."""
    global _scheduled
    if _scheduled:
        return
    with contextlib.suppress(RuntimeError):  # no running loop: a unit test; nothing to give back then
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, return_freed_memory)
        _scheduled = True
