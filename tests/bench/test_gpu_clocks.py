"""bench/gpu_clocks.py reads nvidia-smi's CSV samples (a fake nvidia-smi on PATH here)."""

from __future__ import annotations

import os
import stat
import time

from bench.gpu_clocks import GpuClocks


def test_samples_are_parsed_and_unreadable_lines_skipped(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1980, 650.5\\n1755, 700\\n[N/A], [N/A]\\n1830, 690\\n'\nsleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClocks(interval_ms=100) as clocks:
        for _ in range(200):  # until the reader has the three readable lines (bounded)
            if len(clocks.samples) == 3:
                break
            time.sleep(0.01)
    assert clocks.summary() == {"sm_mhz_median": 1830.0, "sm_mhz_min": 1755.0, "power_w_median": 690.0,
                                "samples": 3}


def test_without_nvidia_smi_the_summary_is_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with GpuClocks() as clocks:
        pass
    assert clocks.summary() == {}
