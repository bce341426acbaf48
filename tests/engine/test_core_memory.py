"""The engine core gives memory back once a burst of image files through its pipe is over (RELIABILITY.md,
"Faults under load": after a flood of 7 MB data URLs the core kept ~200 MB that a trim returns)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from types import SimpleNamespace

from decoder_svc import core_protocol as msg
from decoder_svc import engine_core
from decoder_svc.engine_core import EngineCore


def _wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_burst_of_files_is_followed_by_a_trim_once_idle(monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(engine_core, "release_freed_memory", lambda: trims.append(1) or True)
    idle_engine = SimpleNamespace(source=SimpleNamespace(on_change=None), has_unfinished=lambda: False)
    front, back = multiprocessing.Pipe()
    core = EngineCore(idle_engine, back)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        for i in range(3):  # files of requests the core does not wait for: read, counted, dropped
            front.send(msg.ImageBytes(f"r{i}", [b"x" * 2_000_000]))
        assert _wait_for(lambda: core.trims == 1), (core.trims, core.file_bytes_since_trim)
        front.send(msg.ImageBytes("small", [b"x" * 1000]))  # under the idle minimum: no trim for it
        assert _wait_for(lambda: core.file_bytes_since_trim == 1000)
        front.send(msg.Close())
        loop.join(30)
    finally:
        core.wakeup.close()
    assert not loop.is_alive()
    assert len(trims) == core.trims == 1
