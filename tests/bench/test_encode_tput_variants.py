"""bench/encode_tput.py with spawned encoders, one per --decode-processes value: both runs are reported
side by side, with the encoder's CPU time per image."""

from __future__ import annotations

import json
import sys

import pytest

from bench import encode_tput


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the encoder's CPU time is read from /proc")
def test_decode_processes_side_by_side(tiny_model_dir, tmp_path):
    out = tmp_path / "encode_tput.json"
    encode_tput.main(["--model", str(tiny_model_dir), "--images", "4", "--image-size", "32",
                      "--concurrency", "1,2", "--hf-batches", "", "--host-threads", "2",
                      "--decode-processes", "0,1", "--logs", str(tmp_path / "logs"), "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    by_variant = res["encode_by_decode_processes"]
    assert list(by_variant) == ["0", "1"]
    for levels in by_variant.values():
        assert [r["concurrency"] for r in levels] == [1, 2]
        for r in levels:
            assert r["images_per_s"] > 0 and r["cache_hits"] == 0
            assert r["server_main_cpu_ms_per_image"] >= 0 and r["server_main_cores"] >= 0
            assert r["decode_procs_cpu_ms_per_image"] >= 0
    # /proc counts CPU time in ticks (10 ms): one level of 4 small images may stay under one, all do not
    assert sum(r["server_main_cpu_ms_per_image"] for levels in by_variant.values() for r in levels) > 0
    assert res["encode"] == by_variant["1"], "the targets use the last variant"
    # Threads only: the encoder has no decode processes to spend CPU in.
    assert all(r["decode_procs_cpu_ms_per_image"] == 0 for r in by_variant["0"])


def test_steady_rate_leaves_out_the_ramp_and_the_drain():
    from bench.encode_tput import steady_rate

    # 100 replies: a slow start and end (every 10 ms), a steady middle (every 1 ms)
    times = [0.01 * i for i in range(10)] + [0.1 + 0.001 * i for i in range(80)]
    times += [0.18 + 0.01 * i for i in range(10)]
    assert steady_rate(times) == pytest.approx(1000, rel=0.05)
    assert len(times) / (max(times) - min(times)) < 400  # what the level's images/s would say
    assert steady_rate(times[:9]) is None and steady_rate([1.0] * 20) is None
