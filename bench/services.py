"""Spawning services for a benchmark: encoder and decoder subprocesses on free loopback ports.

The same idea as tests/integration/harness.py (a benchmark must not import from tests/): each service
runs `python -m common.cli <service> ... --port P` from the repository root and is ready when the
standard health service reports SERVING.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from common.health import wait_until_serving
from common.startup import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Service:
    """One service subprocess with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """host:port of the service."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> Service:
        """Start and wait until SERVING; raises with the log tail when it dies or times out."""
        exit_on_sigterm()
        return self.launch().wait(timeout)

    def launch(self) -> Service:
        """Start the process without waiting."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "common.cli", *self.argv, "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        return self

    def wait(self, timeout: float = 600.0) -> Service:
        """Wait until SERVING; stops the process and raises with the log tail when it fails."""
        if not wait_until_serving(self.address, timeout, is_alive=lambda: self.proc.poll() is None):
            self.stop()
            raise RuntimeError(f"{self.name} did not become healthy; log:\n{self.log_tail()}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after timeout."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        """The last n lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def workdir(path: str | None = None) -> Path:
    """A directory for service logs (a fresh temporary one unless given)."""
    out = Path(path) if path else Path(tempfile.mkdtemp(prefix="mmserve-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def encoder_service(model: str | Path, logs: Path, device: str = "cpu", dtype: str = "float32",
                    extra: list[str] | None = None, name: str = "encoder") -> Service:
    """An encoder Service (not started)."""
    argv = ["encoder", "--model", str(model), "--device", device, "--dtype", dtype, *(extra or [])]
    return Service(name, argv, logs / f"{name}.log")


def decoder_service(model: str | Path, encoder_addr: str, logs: Path, device: str = "cpu",
                    dtype: str = "float32", extra: list[str] | None = None, name: str = "decoder") -> Service:
    """A decoder Service wired to encoder_addr (not started)."""
    argv = ["decoder", "--model", str(model), "--encoder", encoder_addr, "--device", device,
            "--dtype", dtype, *(extra or [])]
    return Service(name, argv, logs / f"{name}.log")


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so `finally` blocks stop spawned services."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def start_all(services: list[Service], timeout: float = 600.0) -> bool:
    """Launch every service, then wait for each; on any failure stop them all and raise."""
    exit_on_sigterm()
    try:
        for s in services:
            s.launch()
        for s in services:
            s.wait(timeout)
    except BaseException:
        for s in services:
            s.stop()
        raise
    return True


class Pair:
    """An encoder and a decoder wired together."""

    def __init__(self, model: str | Path, device: str = "cpu", dtype: str = "float32",
                 encoder_args: list[str] | None = None, decoder_args: list[str] | None = None,
                 logs: str | Path | None = None) -> None:
        self.logs = workdir(str(logs) if logs else None)
        self.encoder = encoder_service(model, self.logs, device, dtype, encoder_args)
        self.decoder = decoder_service(model, self.encoder.address, self.logs, device, dtype, decoder_args)

    def start(self, timeout: float = 600.0) -> Pair:
        """Start both at once (the decoder reaches the encoder only on its first image); stop both if
        either fails."""
        start_all([self.encoder, self.decoder], timeout)
        return self

    def stop(self) -> None:
        """Stop the decoder, then the encoder."""
        self.decoder.stop()
        self.encoder.stop()

    def __enter__(self) -> Pair:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
