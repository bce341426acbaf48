"""Sweeping /dev/shm: a dead (even SIGKILLed) encoder's segment goes, a live one's and others' stay.

Owners run in child processes (`python -c`): liveness is the owner's flock, which only another
process can observe. Each test names its segments with its own prefix and sweeps only that prefix, so
it never touches segments of other processes on this host.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.transport import shm

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs /dev/shm")

REPO = Path(__file__).resolve().parents[2]

_OWNER = """
import sys, torch
from common.transport.shm import ShmArena
arena = ShmArena(int(sys.argv[1]), name=sys.argv[2] or None)
arena.write(0, torch.full((int(sys.argv[1]) // 4,), float(sys.argv[3])))
print(arena.name, flush=True)
sys.stdin.readline()  # a line (or EOF) means: close cleanly and exit
arena.close()
"""


class ShmOwner:
    """A child process that owns a ShmArena filled with one float32 value, until told or killed."""

    def __init__(self, capacity: int = 1 << 16, name: str = "", fill: float = 1.0) -> None:
        self.capacity = capacity
        self.proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(capacity), name, str(fill)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"owner failed to start (exit {self.proc.wait(30)})")
        self.name = line
        self.path = shm.SHM_DIR / line

    def kill(self) -> None:
        """SIGKILL: no close(), no atexit, nothing unlinks the segment."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """A clean exit: the owner closes (unlinks) its arena."""
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(30)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def prefix() -> str:
    """A segment-name prefix of this test's own, inside the sweeper's scope."""
    return f"{shm.SEGMENT_PREFIX}test-{secrets.token_hex(4)}-"




def test_sweep_removes_a_sigkilled_owners_segment(owners, prefix):
    owner = owners(name=prefix + "killed", fill=3.0)
    view = shm.read_slice(owner.name, 0, 16, owner.capacity)  # a reader maps it: that takes no lock
    owner.kill()
    assert owner.path.exists(), "SIGKILL leaves the segment behind"
    assert shm.sweep_stale_segments(prefix) == [owner.name]
    assert not owner.path.exists()
    # Unlinking never pulls memory from under a reader: its mapping stays readable.
    assert torch.equal(view.view(torch.float32), torch.full((4,), 3.0))
    assert shm.sweep_stale_segments(prefix) == []


def test_sweep_leaves_a_live_owners_segment(owners, prefix):
    owner = owners(name=prefix + "live", fill=2.0)
    view = shm.read_slice(owner.name, 0, 16, owner.capacity)  # a reader's open must not confuse the lock
    assert shm.sweep_stale_segments(prefix) == []
    assert owner.path.exists()
    assert torch.equal(view.view(torch.float32), torch.full((4,), 2.0))
    owner.kill()  # the lock dies with the owner, even with this process still mapping the segment
    assert shm.sweep_stale_segments(prefix) == [owner.name]


def test_sweep_never_touches_files_outside_its_scope(tmp_path):
    # A private directory stands in for /dev/shm, so the default prefix can be swept without touching
    # other processes' real segments.
    dead = tmp_path / f"{shm.SEGMENT_PREFIX}dead"
    dead.write_bytes(b"x" * 64)  # ours and unlocked: its owner is gone
    foreign = tmp_path / "other-app-segment"
    foreign.write_bytes(b"y" * 64)  # not ours, and unlocked
    near_miss = tmp_path / "mmserve-decoder-state"  # an mmserve name, but not an arena's
    near_miss.write_bytes(b"z")
    (tmp_path / f"{shm.SEGMENT_PREFIX}dir").mkdir()  # ours by name, but not a regular file
    link = tmp_path / f"{shm.SEGMENT_PREFIX}link"
    link.symlink_to(foreign)
    held = tmp_path / f"{shm.SEGMENT_PREFIX}held"
    held.write_bytes(b"h")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); sys.stdin.readline()"), str(held)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert shm.sweep_stale_segments(directory=tmp_path) == [dead.name]
    finally:
        holder.kill()
        holder.wait(30)
    assert foreign.exists() and near_miss.exists() and held.exists() and link.is_symlink()
    assert (tmp_path / f"{shm.SEGMENT_PREFIX}dir").is_dir()
    with pytest.raises(ValueError, match="must start with"):
        shm.sweep_stale_segments("other-", directory=tmp_path)


def test_a_foreign_file_in_dev_shm_survives_a_sweep(prefix):
    foreign = shm.SHM_DIR / f"notmmserve-{prefix.removeprefix(shm.SEGMENT_PREFIX)}seg"
    dead = shm.SHM_DIR / f"{prefix}dead"
    try:
        foreign.write_bytes(b"f")
        dead.write_bytes(b"d")
        assert shm.sweep_stale_segments(prefix) == [dead.name]
        assert foreign.exists()
    finally:
        foreign.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)


def test_owner_holds_its_lock_and_close_unlinks(prefix):
    arena = shm.ShmArena(1 << 12, name=prefix + "mine")
    try:
        fd = os.open(arena.path, os.O_RDONLY)  # another open file description, as a sweeper's would be
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert shm.sweep_stale_segments(prefix) == []
    finally:
        arena.close()
    assert not arena.path.exists()
    with pytest.raises(ValueError, match="must start with"):
        shm.ShmArena(1 << 12, name="not-an-mmserve-segment")


def test_owner_recreates_a_segment_swept_before_it_was_locked(prefix, monkeypatch):
    """A sweeper may flock and unlink a newborn file before its owner locks it: the owner starts over."""
    real_flock = fcntl.flock
    swept: list[str] = []

    def flock_after_a_sweep(fd, op):
        if not swept and op == fcntl.LOCK_EX:  # the owner's first (blocking) lock
            monkeypatch.setattr(shm.fcntl, "flock", real_flock)
            swept.extend(shm.sweep_stale_segments(prefix))
        return real_flock(fd, op)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_a_sweep)
    arena = shm.ShmArena(1 << 12, name=prefix + "newborn")
    try:
        assert swept == [arena.name], "the sweeper took the newborn for a dead owner's"
        assert arena.path.exists() and arena.path.stat().st_size == 1 << 12
        assert shm.sweep_stale_segments(prefix) == []  # the new file is locked
        arena.write(0, torch.arange(4, dtype=torch.float32))
        assert torch.equal(shm.read_slice(arena.name, 0, 16, 1 << 12).view(torch.float32), torch.arange(4.0))
    finally:
        arena.close()
