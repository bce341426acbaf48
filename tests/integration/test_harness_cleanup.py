"""The harness's `mmserve up` leaves nothing running after a failed test: start_up starts it in a process
group of its own and running_up kills that group, its services included. `mmserve up` is stood in for by
a script that starts three children (as up starts an encoder, a decoder and a gateway) and sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import harness
from tests.integration.harness import running_up

FAKE_UP = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(3)]
print("children", *[c.pid for c in children])
print("mmserve is up", flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie waiting to be reaped), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(log: Path) -> list[int]:
    line = next(line for line in log.read_text().splitlines() if line.startswith("children "))
    return [int(pid) for pid in line.split()[1:]]


def _none_left(pids: list[int]) -> bool:
    """Whether every pid has stopped, asked up to 500 times (a killed process stops at once; its parent
    init reaps it soon after)."""
    for _ in range(500):
        if not any(_running(pid) for pid in pids):
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def started() -> Iterator[list[int]]:
    """The pids a test saw started; any still running after it (the harness failed) are killed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fake_up(monkeypatch):
    monkeypatch.setattr(harness, "up_command", lambda model, port: [sys.executable, "-c", FAKE_UP])


class _Failed(Exception):
    pass


def test_a_failing_block_leaves_no_service_running(tmp_path, fake_up, started):
    with pytest.raises(_Failed):
        with running_up(tmp_path, "unused") as (up, log, _):
            started += [up.pid, *_children(log)]
            assert all(_running(pid) for pid in started)
            raise _Failed
    assert _none_left(started)


def test_an_up_that_does_not_stop_on_sigint_is_killed_with_its_services(tmp_path, monkeypatch, started):
    ignores_sigint = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n" + FAKE_UP
    monkeypatch.setattr(harness, "up_command", lambda model, port: [sys.executable, "-c", ignores_sigint])
    monkeypatch.setattr(harness.subprocess.Popen, "wait",
                        _wait_at_most(1.0, harness.subprocess.Popen.wait))
    with pytest.raises(subprocess.TimeoutExpired):  # running_up's wait for up to stop on SIGINT
        with running_up(tmp_path, "unused") as (up, log, _):
            started += [up.pid, *_children(log)]
    assert _none_left(started)


def _wait_at_most(limit: float, real):
    """Popen.wait with its timeout cut to `limit` seconds: running_up's 60 s wait for SIGINT, shortened."""

    def wait(self, timeout=None):
        return real(self, timeout=limit if timeout is not None else None)

    return wait
