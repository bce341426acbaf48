"""Native (OS-level) thread names, so `top -H`, /proc and profilers show what each thread is.

Python before 3.14 names its threads only inside the interpreter; the kernel sees every one as the
process's name. The encoder names its long-lived threads (the vision worker, the preprocessing pools)
and `bench/encode_cost.py` reads the names to split the server's CPU time by thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15
_MAX_BYTES = 15  # the kernel keeps 16 bytes, the last one NUL

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        _libc = None


def set_native_thread_name(name: str) -> None:
    """Name the calling thread for the OS (Linux; a no-op elsewhere). Names longer than 15 bytes are cut."""
    if _libc is None:
        return
    _libc.prctl(_PR_SET_NAME, name.encode(errors="replace")[:_MAX_BYTES], 0, 0, 0)
