"""README's main command, `mmserve up`, and the client CLI, as a user runs them."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from common.client import DecoderClient
from common.images import encode_png
from gateway.health import http_healthy
from tests.cli_errors import assert_usage_error, busy_port, decoy_model, run_cli
from tests.integration.harness import ROOT, free_port
from tests.oracle import make_image


def _cli(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_mmserve_up_makes_the_model_serves_and_stops_on_sigint(tmp_path, tiny_model_dir):
    env = {**os.environ, "MMSERVE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    enc_port, dec_port, metrics_port, gateway_port = free_port(), free_port(), free_port(), free_port()
    log = (tmp_path / "up.log").open("w+")
    up = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--encoder-port", str(enc_port),
         "--decoder-port", str(dec_port), "--decoder-arg=--metrics-port", f"--decoder-arg={metrics_port}",
         "--gateway-port", str(gateway_port)],
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
        (group,) = stats["kv_groups"]  # LLaVA: one group of every layer, idle (zeros printed too)
        assert group["name"] == "full" and group["window"] == 0 and group["blocks_used"] == 0
        assert group["blocks_total"] == stats["kv_blocks_total"]
        enc_stats = json.loads(_cli("stats", f"127.0.0.1:{enc_port}", env=env).stdout)
        assert enc_stats["service"] == "encoder" and enc_stats["active_leases"] == 0
        assert _cli("health", addr, env=env).returncode == 0
        with DecoderClient(addr, timeout=30) as client:  # a role outside the template's is refused
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(chat=[{"role": "user", "content": "hi"},
                                           {"role": "{{ 7*7 }}", "content": "x"}], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "message 1: unsupported role" in err.value.details()
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "mmserve_decoder_time_to_first_token_seconds_count" in metrics
        # The stats record's fields are metrics too, refreshed every second: the same numbers as GetStats.
        deadline = time.monotonic() + 10
        while "mmserve_decoder_requests_finished_total 2.0" not in metrics and time.monotonic() < deadline:
            time.sleep(0.5)
            metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "mmserve_decoder_requests_finished_total 2.0" in metrics
        assert 'mmserve_decoder_embedding_transports_total{transport="shm"} 1.0' in metrics
        assert 'mmserve_decoder_kv_groups_blocks_used{group="full"} 0.0' in metrics
        # README's OpenAI client call, against the gateway `mmserve up` started.
        from openai import OpenAI

        openai_client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="-", max_retries=0)
        image_url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        chat = openai_client.chat.completions.create(
            model="tiny", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": "What is in this picture?"}]}])
        assert chat.usage.completion_tokens >= 1 and chat.choices[0].finish_reason in ("stop", "length")

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert _cli("health", addr, env=env).returncode == 1  # both children are gone
        assert not http_healthy(f"http://127.0.0.1:{gateway_port}/health")  # and the gateway
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_health_of_nothing_is_unreachable_exit_1():
    result = _cli("health", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1 and "UNREACHABLE" in result.stdout


# User errors: exit code 2 and one `mmserve <cmd>: error: ...` line, no traceback. The decoy model
# cannot load, so the cases that use it prove the error comes before any loading.

def test_generate_usage_errors(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    last = assert_usage_error(run_cli("generate", "--addr", addr, "--prompt", "x", "--image",
                                      str(tmp_path / "missing.png"), timeout=30), "--image", "no such file")
    assert last.startswith("mmserve generate: error:")
    assert_usage_error(run_cli("generate", "--addr", addr, "--prompt", "x", "--max-tokens", "-5", timeout=30),
                       "--max-tokens", "not -5")
    assert_usage_error(run_cli("generate", "--addr", addr, "--prompt", "x", "--top-k", "x", timeout=30),
                       "--top-k", "not an integer")


def test_make_model_usage_errors(tmp_path):
    result = run_cli("make-model", "--preset", "bogus", "--out", str(tmp_path / "m"), timeout=60)
    assert_usage_error(result, "unknown preset 'bogus'", "tiny")
    assert not (tmp_path / "m").exists()
    (tmp_path / "file").write_text("")
    assert_usage_error(run_cli("make-model", "--out", str(tmp_path / "file"), timeout=30), "not a directory")


def test_up_usage_errors(tmp_path):
    assert_usage_error(run_cli("up", "--model", str(tmp_path / "missing"), timeout=30), "--model")
    with busy_port() as port:  # found before a model is made or a service started
        result = run_cli("up", "--model", str(decoy_model(tmp_path / "m")), "--encoder-port", str(port),
                         "--decoder-port", str(free_port()), timeout=30)
    assert_usage_error(result, f"--encoder-port {port}", "already in use")
    with busy_port() as port:  # the gateway's port too
        result = run_cli("up", "--model", str(decoy_model(tmp_path / "m")), "--encoder-port",
                         str(free_port()), "--decoder-port", str(free_port()), "--gateway-port", str(port),
                         timeout=30)
    assert_usage_error(result, f"--gateway-port {port}", "already in use")


@pytest.mark.parametrize("args, needle", [
    (["--block-size", "0"], "--block-size: must be at least 1, not 0"),
    (["--dtype", "float64x"], "unknown dtype 'float64x'"),
    (["--num-kv-blocks", "-3"], "--num-kv-blocks"),
    (["--encoder-timeout", "0"], "--encoder-timeout"),
])
def test_decoder_bad_option_values_are_usage_errors(tmp_path, args, needle):
    result = run_cli("decoder", "--model", str(decoy_model(tmp_path / "m")), "--port", "0",
                     "--encoder", "127.0.0.1:1", *args, timeout=30)
    assert_usage_error(result, needle)


def test_decoder_usage_errors(tmp_path):
    last = assert_usage_error(run_cli("decoder", "--model", str(tmp_path / "missing"), "--encoder",
                                      "127.0.0.1:1", timeout=30), "--model", "not a directory")
    assert last.startswith("mmserve decoder: error:")
    model = str(decoy_model(tmp_path / "m"))
    assert_usage_error(run_cli("decoder", "--model", model, timeout=30), "--encoder")
    for option in ("--port", "--metrics-port"):
        with busy_port() as port:
            ports = ["--port", str(port)] if option == "--port" else ["--port", "0", option, str(port)]
            result = run_cli("decoder", "--model", model, "--encoder", "127.0.0.1:1", *ports, timeout=30)
        assert_usage_error(result, f"{option} {port}", "already in use")


def test_decoder_kv_cache_too_small_for_the_warm_up_is_a_usage_error(tiny_model_dir):
    result = run_cli("decoder", "--model", str(tiny_model_dir), "--port", "0", "--encoder", "127.0.0.1:1",
                     "--num-kv-blocks", "1", "--log-level", "WARNING", timeout=120)
    assert_usage_error(result, "warm-up request does not fit", "--num-kv-blocks")
