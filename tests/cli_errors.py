"""Helpers for tests of the CLI's user errors: run `mmserve` in a subprocess, check the one-line error."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m common.cli ARGS` from the repo root; TimeoutExpired fails the test."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def assert_usage_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, no traceback, and a last stderr line `...: error: ...` holding every needle.
    (argparse's usage lines and log lines may come before it.) Returns that line."""
    assert result.returncode == 2, f"exit {result.returncode}; stderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert "error: " in last and all(n in last for n in needles), result.stderr
    return last


def decoy_model(directory: Path) -> Path:
    """A directory that passes the --model check (config.json, *.safetensors) but cannot load: a
    command that fails with the expected one-line error on it failed before loading the model."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")
    return directory


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]
