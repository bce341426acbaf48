"""bench.chaos without services: its fault proxy on a local echo server, and the checks it reports on
(each must fail on what it is there to catch)."""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest

from bench import chaos
from bench.fault_proxy import FaultProxy


@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def pump(conn):
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:  # the proxy reset it
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def _ask(port: int, payload: bytes = b"ping", timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(payload)
        return conn.recv(65536)


def test_the_proxy_passes_delays_holds_and_resets(echo):
    proxy = FaultProxy(echo).start()
    try:
        assert _ask(proxy.port) == b"ping"
        proxy.mode = "blackhole"
        with pytest.raises(TimeoutError):
            _ask(proxy.port, timeout=0.5)  # connected, and nothing comes back
        proxy.mode = "delay"
        assert _ask(proxy.port) == b"ping"
        proxy.mode = "pass"
        conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        conn.sendall(b"x")
        assert conn.recv(10) == b"x"
        assert proxy.reset_all() >= 1
        with pytest.raises(ConnectionResetError):
            for _ in range(50):  # the RST arrives; reading or writing then fails
                conn.sendall(b"y")
                if not conn.recv(10):
                    raise ConnectionResetError("closed")
                time.sleep(0.05)
        conn.close()
        assert _ask(proxy.port) == b"ping"  # new connections pass again
    finally:
        proxy.stop()


def test_the_proxy_cuts_or_holds_one_answer_and_keeps_the_upstream_side_open(echo):
    proxy = FaultProxy(echo).start()
    try:
        proxy.cut_answer_with = b"secret"
        with pytest.raises(ConnectionResetError):  # the client's side is reset; the echo server's stays
            if not _ask(proxy.port, b"a secret answer"):
                raise ConnectionResetError("closed")
        assert proxy.answers_cut == 1 and proxy.cut_answer_with == b""
        assert _ask(proxy.port, b"secret") == b"secret"  # once only
        proxy.hold_answer_with = b"held"
        with pytest.raises(TimeoutError):  # connected, and the answer never comes
            _ask(proxy.port, b"held", timeout=0.5)
        assert proxy.answers_held == 1
        assert _ask(proxy.port, b"held") == b"held"
    finally:
        proxy.stop()


def test_a_proxy_to_a_dead_upstream_closes_the_connection():
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    proxy = FaultProxy(port).start()
    try:
        assert _ask(proxy.port) == b""
    finally:
        proxy.stop()


def _args() -> argparse.Namespace:
    return chaos.build_arg_parser().parse_args(["--model", "m"])


def _clean_result() -> dict:
    return {"counts": {"completed": 10, "lost": 0}, "books": {"checks": {"decoder1_kv": True}},
            "died": [], "orphaned_pids": [], "orphaned_shm_segments": [],
            "faults": {"decoder_drain": {"exit_within_drain_timeout_plus_2s": True,
                                         "not_serving_before_exit": True},
                       "encoder_kill": {"children_alive_after_kill": []}}}


def test_a_clean_result_passes():
    assert all(chaos.checks_of(_clean_result(), _args()).values())


@pytest.mark.parametrize("name, spoil", [
    ("none_lost", lambda r: r["counts"].update(lost=1)),
    ("requests_served", lambda r: r["counts"].update(completed=0)),
    ("books_clean", lambda r: r["books"]["checks"].update(decoder1_kv=False)),
    ("books_clean", lambda r: r.pop("books")),
    ("no_service_died", lambda r: r["died"].append("encoder1")),
    ("no_orphaned_processes", lambda r: r["orphaned_pids"].append(4242)),
    ("no_orphaned_shm", lambda r: r["orphaned_shm_segments"].append("mmserve-enc-x")),
    ("drain_exit_in_time", lambda r: r["faults"]["decoder_drain"].update(
        exit_within_drain_timeout_plus_2s=False)),
    ("not_serving_before_exit", lambda r: r["faults"]["decoder_drain"].update(not_serving_before_exit=False)),
    ("killed_encoder_children_gone", lambda r: r["faults"]["encoder_kill"].update(
        children_alive_after_kill=[7])),
    ("killed_decoder_core_gone", lambda r: r["faults"].update(
        decoder_kill={"children_alive_after_kill": [8]})),
    ("no_error", lambda r: r.update(error="RuntimeError: x")),
])
def test_each_check_fails_on_what_it_catches(name, spoil):
    result = _clean_result()
    spoil(result)
    assert chaos.checks_of(result, _args())[name] is False


def test_counts_and_windows():
    recs = [chaos.Record("image", True, 1, 1.0, "completed", ttft=0.1, e2e=0.2),
            chaos.Record("text", False, 2, 5.0, "completed", retries=2, e2e=0.5),
            chaos.Record("video", True, 1, 5.5, "lost", "error after streaming began")]
    c = chaos.counts(recs)
    assert (c["completed"], c["completed_after_retry"], c["retriable_statuses_before_streaming"], c["lost"]) \
        == (2, 1, 2, 1)
    windows = chaos.window_summary(recs, [{"name": "encoder_kill", "start": 4.0, "end": 6.0}])
    assert windows["steady"]["requests"] == 1 and windows["encoder_kill"]["requests"] == 2
    assert windows["steady"]["ttft"]["n"] == 1


def test_streams_a_decoder_kill_cut_are_counted_apart_from_the_lost():
    killed_at = 1000.0
    recs = [chaos.Record("image", True, 1, 1.0, "lost", "error after streaming began: x", ended_at=1001.0),
            chaos.Record("text", True, 1, 1.0, "lost", "error after streaming began: x", ended_at=1030.0),
            chaos.Record("text", False, 1, 1.0, "lost", "status 500: x", ended_at=1001.0),
            chaos.Record("text", True, 1, 1.0, "completed", ended_at=1001.0)]
    assert chaos.cut_by_kill(recs, {"decoder_kill": {"killed_at": killed_at}}) == 1
    c = chaos.counts(recs)
    assert (c["completed"], c["cut_by_kill"], c["lost"]) == (1, 1, 2)  # later, or not a stream: lost
    assert chaos.cut_by_kill(recs, {}) == 0


def test_unknown_faults_are_refused():
    with pytest.raises(SystemExit):
        chaos.selected_faults("encoder_kill,meteor")
    assert chaos.selected_faults("all") == list(chaos.FAULTS)


def test_orphans_are_told_by_pid_and_start_time():
    import os
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    ours = chaos.identities([child.pid, os.getpid()])
    assert chaos.alive_pids(ours) == sorted([child.pid, os.getpid()])
    child.kill()
    child.wait()
    assert chaos.alive_pids(ours) == [os.getpid()]
    assert chaos.alive_pids({(os.getpid(), -1)}) == []  # the same pid, another process: not ours
