"""bench/encode_cost.py on CPU: three request kinds against its own encoder, CPU split by thread."""

from __future__ import annotations

import json
import sys

import pytest

from bench import encode_cost


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU comes from /proc")
def test_encode_cost_splits_cpu_by_request_kind_and_thread(tiny_model_dir, tmp_path):
    out = tmp_path / "encode_cost.json"
    encode_cost.main(["--model", str(tiny_model_dir), "--images", "6", "--image-size", "32",
                      "--concurrency", "3", "--decode-processes", "1", "--out", str(out),
                      "--logs", str(tmp_path / "logs")])
    payload = json.loads(out.read_text())
    levels = payload["results"]
    assert list(levels) == ["miss", "hit_by_bytes", "hit_by_hash"]
    assert levels["miss"]["cache_hits"] == 0
    assert levels["hit_by_bytes"]["cache_hits"] == levels["hit_by_hash"]["cache_hits"] == 6
    for level in levels.values():
        assert level["images"] == 6 and level["images_per_s"] > 0 and level["latency"]["n"] == 6
        threads = level["cpu_ms_per_image_by_thread"]
        assert level["main_process_cpu_ms_per_image"] == pytest.approx(sum(threads.values()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_thread_cpu_reads_native_thread_names():
    import os
    import threading
    import time

    from common.thread_names import set_native_thread_name

    burnt, may_exit = threading.Event(), threading.Event()

    def busy() -> None:
        set_native_thread_name("vision-worker")
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        burnt.set()
        may_exit.wait(60)  # alive (so in /proc) until it has been read

    before = encode_cost.thread_cpu(os.getpid())
    t = threading.Thread(target=busy)
    t.start()
    try:
        assert burnt.wait(60)
        after = encode_cost.thread_cpu(os.getpid())
    finally:
        may_exit.set()
        t.join()
    assert after["vision-worker"] - before.get("vision-worker", 0.0) >= 0.05
    assert "loop (main thread)" in after
