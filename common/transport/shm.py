"""CPU arena in POSIX shared memory: a file under /dev/shm, mapped by producer and readers.

Readers map the file with mmap directly instead of `multiprocessing.shared_memory`: on Python < 3.13
attaching registers the segment with the reader's resource tracker, which unlinks the producer's
segment when the reader exits. Only the producer, or a sweeper once the producer is dead, unlinks.

Liveness rule (safe across PID namespaces, so no PID checks): the producer holds
`flock(LOCK_EX)` on its segment's file for its whole life, on a descriptor it keeps open; the kernel
drops the lock when the process dies, however it dies (SIGKILL and OOM included). A starting encoder
calls `sweep_stale_segments()`: for each /dev/shm file named with SEGMENT_PREFIX it tries
`flock(LOCK_EX | LOCK_NB)` and unlinks only the files whose lock it gets, i.e. whose owner is dead.
Readers never flock: flock locks belong to an open file description, so a reader's own open neither
blocks the producer's lock nor keeps a dead producer's segment from being swept (a reader that still
maps a swept segment keeps its pages until it unmaps). A process forked (not exec'd) from the producer
inherits the locked descriptor and keeps the segment alive while it lives.

Readers cache one mapping per segment, keyed by name and the file's identity (device, inode), so a
segment re-created under the same name is mapped afresh; mappings of segments that were unlinked or
replaced are dropped when a new segment is mapped, and `forget_segment` drops one on request.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from common.transport.arena import Arena

log = logging.getLogger("mmserve.transport")

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "mmserve-enc-"  # every producer segment's name starts with this; the sweeper's scope
_CREATE_ATTEMPTS = 8


def shm_available() -> bool:
    """True on hosts with a POSIX shared-memory filesystem."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def shm_free_bytes() -> int:
    """Bytes free on /dev/shm (containers default to 64 MiB unless given shm_size or ipc: host)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")


def segment_exists(name: str) -> bool:
    """True when /dev/shm/name exists here, i.e. the producer runs on this host."""
    return _valid_name(name) and (SHM_DIR / name).exists()


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _SweptWhileCreating(Exception):
    """A sweeper unlinked our new file between its creation and our flock."""


def _create_locked(path: Path, size: int) -> tuple[int, mmap.mmap]:
    """Create path, flock it for life, size and map it: (the locked descriptor, the mapping)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Between O_CREAT and flock the file was unlocked: a sweeper may have taken it for a dead
        # owner's and unlinked it. It unlinks only while holding the lock, so by now that is visible.
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            current = None
        if current is None or _ident(current) != _ident(os.fstat(fd)):
            raise _SweptWhileCreating
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException as exc:
        if not isinstance(exc, _SweptWhileCreating):
            _unlink_if_same(path, fd)
        os.close(fd)
        raise


def _unlink_if_same(path: Path, fd: int) -> bool:
    """Unlink path only if it still names the file open on fd (never a newer file of the same name)."""
    try:
        if _ident(os.lstat(path)) != _ident(os.fstat(fd)):
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


class ShmArena(Arena):
    """The producer's arena: creates /dev/shm/<name> of capacity bytes, flocked while it lives.

    close() unlinks it; if the process dies first, the next encoder's `sweep_stale_segments` does.
    """

    def __init__(self, capacity: int, name: str | None = None) -> None:
        # tmpfs accepts ftruncate past its size and then SIGBUSes the writer: refuse up front.
        free = shm_free_bytes()
        if capacity > free:
            raise MemoryError(f"/dev/shm has {free} bytes free, the arena needs {capacity}: lower "
                              "--cache-bytes or give the container more shared memory (shm_size, ipc: host)")
        if name is not None and not name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"segment name {name!r} must start with {SEGMENT_PREFIX!r}, the sweeper's scope")
        self.capacity = capacity
        self.device = torch.device("cpu")
        for _ in range(_CREATE_ATTEMPTS):
            self.name = name or f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self.path = SHM_DIR / self.name
            try:
                self._lock_fd, self._mmap = _create_locked(self.path, capacity)
                break
            except _SweptWhileCreating:
                continue
        else:
            raise RuntimeError(f"could not create a shared memory segment in {_CREATE_ATTEMPTS} attempts: "
                               "another process keeps sweeping it")
        self._buf = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Unlink before dropping the lock: a sweeper must never see our file unlocked.
        _unlink_if_same(self.path, self._lock_fd)
        os.close(self._lock_fd)
        # The mapping itself is released when the last tensor view over it is collected.


def sweep_stale_segments(prefix: str = SEGMENT_PREFIX, directory: Path | None = None) -> list[str]:
    """Unlink the segments of dead producers; returns the names removed.

    Looks at regular files in directory (/dev/shm) whose names start with prefix (which must start
    with SEGMENT_PREFIX: nothing else is ours) and unlinks those whose flock it can take without
    waiting. A live producer's segment (lock held) and anything not ours are left alone. Call it when
    an encoder starts, before sizing its arena: a SIGKILLed encoder's segment still takes /dev/shm space.
    """
    if not prefix.startswith(SEGMENT_PREFIX):
        raise ValueError(f"sweep prefix {prefix!r} must start with {SEGMENT_PREFIX!r}")
    directory = SHM_DIR if directory is None else directory
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    removed = []
    for name in names:
        if not name.startswith(prefix):
            continue
        path = directory / name
        try:  # O_NOFOLLOW: never act through a symlink; O_NONBLOCK: a FIFO must not hang the open
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone already, a symlink, or another user's
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its producer is alive
                continue
            if _unlink_if_same(path, fd):
                removed.append(name)
        finally:
            os.close(fd)  # releases our lock
    if removed:
        log.warning("removed %d shared memory segment(s) left by dead encoders: %s", len(removed),
                    ", ".join(removed))
    return removed


@dataclass
class _Mapping:
    ident: tuple[int, int]  # (device, inode) of the file mapped: a re-created segment differs
    mmap: mmap.mmap
    buf: torch.Tensor


_readers: dict[str, _Mapping] = {}
_readers_lock = threading.Lock()
shm_opens = 0  # how many segments this process has mapped (tests check it is once per arena)


def _map_reader(path: Path, size: int) -> _Mapping:
    # No flock here: readers must not look like a live owner to the sweeper (see the module docstring).
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_size < size:
            raise ValueError(f"shared memory segment {path.name} is smaller than {size} bytes")
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
    return _Mapping(_ident(st), m, torch.frombuffer(m, dtype=torch.uint8))


def _drop_dead_locked(keep: str) -> None:
    """Forget mappings (other than keep) whose segment was unlinked or replaced. Caller holds the lock."""
    for name in [n for n in _readers if n != keep]:
        try:
            alive = _ident(os.stat(SHM_DIR / name)) == _readers[name].ident
        except OSError:
            alive = False
        if not alive:
            del _readers[name]


def open_segment(name: str, size: int) -> torch.Tensor:
    """The whole segment as a uint8 tensor, mapped once per process per incarnation of the segment.

    Raises FileNotFoundError when no segment of that name is on this host (and forgets any mapping of
    an earlier one: its producer closed it or died and was swept).
    """
    global shm_opens
    if not _valid_name(name):
        raise FileNotFoundError(f"shared memory segment {name!r} is not on this host")
    path = SHM_DIR / name
    with _readers_lock:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            _readers.pop(name, None)
            raise FileNotFoundError(f"shared memory segment {name!r} is not on this host") from None
        cached = _readers.get(name)
        if cached is not None and cached.ident == _ident(st) and cached.buf.numel() >= size:
            return cached.buf
        mapping = _map_reader(path, size)
        _readers[name] = mapping  # replaces an earlier incarnation's mapping of this name
        shm_opens += 1
        # A new segment often means an encoder restarted: let go of the ones that are gone. Dropping
        # our reference unmaps once no view is left, so a view still in use stays valid.
        _drop_dead_locked(keep=name)
        return mapping.buf


def forget_segment(name: str) -> bool:
    """Drop this process's cached mapping of a segment (unmapped once its last view is gone)."""
    with _readers_lock:
        return _readers.pop(name, None) is not None


def open_mappings() -> int:
    """How many segments this process holds mapped in its cache."""
    with _readers_lock:
        return len(_readers)


def read_slice(name: str, offset: int, nbytes: int, arena_nbytes: int) -> torch.Tensor:
    """A uint8 view of [offset, offset + nbytes) of another process's segment (no copy)."""
    size = arena_nbytes or offset + nbytes
    buf = open_segment(name, size)
    if offset + nbytes > buf.numel():
        raise ValueError("slice past the end of the shared memory segment")
    return buf[offset:offset + nbytes]
