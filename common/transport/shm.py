"""CPU arena in POSIX shared memory: a file under /dev/shm, mapped by producer and readers.

Readers map the file with mmap directly instead of `multiprocessing.shared_memory`: on Python < 3.13
attaching registers the segment with the reader's resource tracker, which unlinks the producer's
segment when the reader exits. Only the producer ever unlinks.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from pathlib import Path

import torch

from common.transport.arena import Arena

SHM_DIR = Path("/dev/shm")


def shm_available() -> bool:
    """True on hosts with a POSIX shared-memory filesystem."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def shm_free_bytes() -> int:
    """Bytes free on /dev/shm (containers default to 64 MiB unless given shm_size or ipc: host)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def segment_exists(name: str) -> bool:
    """True when /dev/shm/name exists here, i.e. the producer runs on this host."""
    return bool(name) and "/" not in name and (SHM_DIR / name).exists()


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"shared memory segment {path.name} is smaller than {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed


class ShmArena(Arena):
    """The producer's arena: creates /dev/shm/<name> of capacity bytes; close() unlinks it."""

    def __init__(self, capacity: int, name: str | None = None) -> None:
        # tmpfs accepts ftruncate past its size and then SIGBUSes the writer: refuse up front.
        free = shm_free_bytes()
        if capacity > free:
            raise MemoryError(f"/dev/shm has {free} bytes free, the arena needs {capacity}: lower "
                              "--cache-bytes or give the container more shared memory (shm_size, ipc: host)")
        self.name = name or f"mmserve-enc-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = SHM_DIR / self.name
        self.capacity = capacity
        self.device = torch.device("cpu")
        self._mmap = _map(self.path, capacity, create=True)
        self._buf = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.path.unlink(missing_ok=True)
        # The mapping itself is released when the last tensor view over it is collected.


_readers: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
_readers_lock = threading.Lock()
shm_opens = 0  # how many segments this process has mapped (tests check it is once per arena)


def open_segment(name: str, size: int) -> torch.Tensor:
    """The whole segment as a uint8 tensor, mapped once per process and cached by name."""
    global shm_opens
    with _readers_lock:
        cached = _readers.get(name)
        if cached is not None and cached[1].numel() >= size:
            return cached[1]
        if not segment_exists(name):
            raise FileNotFoundError(f"shared memory segment {name!r} is not on this host")
        m = _map(SHM_DIR / name, size, create=False)
        buf = torch.frombuffer(m, dtype=torch.uint8)
        _readers[name] = (m, buf)
        shm_opens += 1
        return buf


def read_slice(name: str, offset: int, nbytes: int, arena_nbytes: int) -> torch.Tensor:
    """A uint8 view of [offset, offset + nbytes) of another process's segment (no copy)."""
    size = arena_nbytes or offset + nbytes
    buf = open_segment(name, size)
    if offset + nbytes > buf.numel():
        raise ValueError("slice past the end of the shared memory segment")
    return buf[offset:offset + nbytes]
