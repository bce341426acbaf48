"""Starts the encoder and decoder as real subprocesses on free loopback ports and talks to them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.client import DecoderClient, EncoderClient
from common.health import wait_until_serving
from common.security.tls import ClientTls
from common.startup import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    """One service subprocess and its log file."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    health_tls: ClientTls | None = None  # for a service that serves TLS

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "common.cli", *self.argv,
                                      "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=env)
        if not wait_until_serving(self.address, timeout, is_alive=lambda: self.proc.poll() is None,
                                  tls=self.health_tls):
            self.stop()
            raise RuntimeError(f"{self.name} did not become healthy; log:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code, pid, self.proc = self.proc.returncode, self.proc.pid, None
        # A killed encoder cannot unlink its shared-memory arena: do it for it.
        for segment in Path("/dev/shm").glob(f"mmserve-enc-{pid}-*"):
            segment.unlink(missing_ok=True)
        return code

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


@dataclass
class Pair:
    """An encoder and a decoder wired together."""

    model_dir: Path | str  # a directory or a Hub id
    workdir: Path
    encoder_args: list[str] = field(default_factory=list)
    decoder_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for both services

    def __post_init__(self) -> None:
        self.encoder = Service("encoder", ["encoder", "--model", str(self.model_dir), *self.encoder_args],
                               free_port(), self.workdir / "encoder.log", env=self.env)
        self.decoder = Service(
            "decoder", ["decoder", "--model", str(self.model_dir), "--encoder", "", *self.decoder_args],
            free_port(), self.workdir / "decoder.log", env=self.env)
        self.decoder.argv[self.decoder.argv.index("--encoder") + 1] = self.encoder.address

    def start(self) -> Pair:
        self.encoder.start()
        self.decoder.start()
        return self

    def stop(self) -> None:
        self.decoder.stop()
        self.encoder.stop()

    def decoder_client(self, timeout: float | None = 120.0) -> DecoderClient:
        return DecoderClient(self.decoder.address, timeout=timeout)

    def encoder_client(self, timeout: float | None = 30.0) -> EncoderClient:
        return EncoderClient(self.encoder.address, timeout=timeout)

    def wait_idle(self, timeout: float = 30.0) -> tuple:
        """Poll until the decoder holds no blocks or leases and the encoder no leases; return both stats."""
        deadline = time.monotonic() + timeout
        with self.decoder_client() as dec, self.encoder_client() as enc:
            while True:
                d, e = dec.stats(), enc.stats()
                idle = (d.running == 0 and d.waiting == 0 and d.kv_blocks_used == 0 and d.active_leases == 0
                        and e.active_leases == 0)
                if idle or time.monotonic() > deadline:
                    return d, e
                time.sleep(0.1)


def up_command(model: str, gateway_port: int) -> list[str]:
    """The command start_up runs: `mmserve up` on free ports (tests of the harness replace it)."""
    return [sys.executable, "-m", "common.cli", "up", "--model", model, "--encoder-port", str(free_port()),
            "--decoder-port", str(free_port()), "--gateway-port", str(gateway_port)]


def kill_group(up: subprocess.Popen) -> None:
    """Kill `mmserve up` and every process it started (its encoder, decoder and gateway share its process
    group: start_up starts it in a session of its own), then reap it."""
    try:
        os.killpg(up.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is empty: up and its services have all exited
    up.kill()  # a no-op once it has exited; never a wait on an `up` left running
    up.wait()


def start_up(tmp_path: Path, model: str, env_extra: dict[str, str] | None = None,
             timeout: float = 240.0) -> tuple[subprocess.Popen, Path, int]:
    """`mmserve up --model model` on free ports, waited for until it says it is up: (process, its log,
    the gateway's port). In a process group of its own: the caller stops it (SIGINT) and, whatever
    happened, kills its group (kill_group), so no service outlives a failed test."""
    env = {**os.environ, "MMSERVE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    port = free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("w") as log:
        up = subprocess.Popen(up_command(model, port), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while "mmserve is up" not in log_path.read_text():
            if up.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mmserve up did not come up:\n{log_path.read_text()}")
            time.sleep(0.5)
    except BaseException:
        kill_group(up)
        raise
    return up, log_path, port


@contextmanager
def running_up(tmp_path: Path, model: str, **kwargs) -> Iterator[tuple[subprocess.Popen, Path, int]]:
    """start_up's (process, log, port) for the block; after it, `mmserve up` must stop on SIGINT with exit
    status 0. Its process group is killed after the block, whether it raised or `up` did not stop."""
    up, log_path, port = start_up(tmp_path, model, **kwargs)
    try:
        yield up, log_path, port
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        kill_group(up)
