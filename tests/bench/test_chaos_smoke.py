"""bench.chaos on qwen2.5-vl-tiny, CPU, short: the fleet behind the gateway goes through every fault of
the schedule and no request is lost, the books come clean, nothing is orphaned. Counts and states only,
no timing (the benchmark's own drain-time check is left out here). Starts services in a process group
of their own, killed whatever happens: slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_smoke_cpu(qwen_model_dir, tmp_path):
    out = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "bench.chaos", "--model", str(qwen_model_dir), "--rate", "1.5",
            "--steady-seconds", "4", "--gap-seconds", "3", "--restart-after", "1", "--stall-seconds", "3",
            "--link-fault-seconds", "1", "--flood-seconds", "4", "--flood-rate", "4", "--drain-timeout", "6",
            "--start-timeout", "240", "--request-timeout", "90", "--logs", str(tmp_path / "logs"),
            # decoder_kill (a replacement decoder's start) would take it past ~150 s on 2 cores: not here
            "--faults", "encoder_kill,decoder_drain,encoder_stall,link_faults,cache_flood",
            "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=900)  # its exit code also counts the drain's time: not used
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the services too, should the benchmark have died
        except ProcessLookupError:
            pass
    res = json.loads(out.read_text())["results"]
    # Every check but the drain's exit time (a wall-clock figure: reported, not asserted here).
    failed = {k: v for k, v in res["checks"].items() if not v and k != "drain_exit_in_time"}
    assert not failed, (failed, res.get("error"), res.get("records_lost"), output[-3000:])
    counts = res["counts"]
    assert counts["lost"] == 0 and counts["completed"] == counts["requests"] > 0
    assert set(res["faults"]) == {"encoder_kill", "decoder_drain", "encoder_stall", "link_faults",
                                  "cache_flood"}
    drain = res["faults"]["decoder_drain"]
    assert drain["not_serving_before_exit"] and drain["exit_code"] == 0
    assert all(res["books"]["checks"].values())
    assert not res["orphaned_pids"] and not res["orphaned_shm_segments"]
