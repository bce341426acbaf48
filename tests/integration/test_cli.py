"""README's main command, `mmserve up`, and the client CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from common.images import encode_png
from tests.integration.harness import ROOT, free_port
from tests.oracle import make_image


def _cli(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_mmserve_up_makes_the_model_serves_and_stops_on_sigint(tmp_path, tiny_model_dir):
    env = {**os.environ, "MMSERVE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    enc_port, dec_port, metrics_port = free_port(), free_port(), free_port()
    log = (tmp_path / "up.log").open("w+")
    up = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--encoder-port", str(enc_port),
         "--decoder-port", str(dec_port), "--decoder-arg=--metrics-port", f"--decoder-arg={metrics_port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "mmserve is up" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "mmserve up did not come up"
            time.sleep(0.5)
        assert (tmp_path / "home" / "models" / "tiny" / "config.json").exists()  # made on first use
        image = tmp_path / "cat.png"
        image.write_bytes(encode_png(make_image(5)))
        addr = f"127.0.0.1:{dec_port}"
        for _ in range(2):
            # Long enough that full KV blocks cover the image (it starts at token 1) on the second run.
            gen = _cli("generate", "--addr", addr, "--prompt", "What is this? Describe every part of it "
                       "in great detail, please, with colours and shapes.", "--image", str(image),
                       "--max-tokens", "6", "--usage", env=env)
            assert gen.returncode == 0, gen.stderr
        usage = json.loads(gen.stderr.strip().splitlines()[-1])
        assert usage["usage"]["images"] == 1 and usage["usage"]["completion_tokens"] >= 1
        assert usage["usage"]["images_skipped_by_kv_reuse"] == 1  # the second run reused the first's KV

        stats = json.loads(_cli("stats", addr, env=env).stdout)
        assert stats["service"] == "decoder" and stats["requests_finished"] == 2  # the warm-up is not counted
        assert stats["embedding_transports"] == {"shm": 1}  # same host: shared memory, no copy
        enc_stats = json.loads(_cli("stats", f"127.0.0.1:{enc_port}", env=env).stdout)
        assert enc_stats["service"] == "encoder" and enc_stats["active_leases"] == 0
        assert _cli("health", addr, env=env).returncode == 0
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "mmserve_decoder_time_to_first_token_seconds_count" in metrics

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert _cli("health", addr, env=env).returncode == 1  # both children are gone
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_health_of_nothing_is_unreachable_exit_1():
    result = _cli("health", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1 and "UNREACHABLE" in result.stdout
