"""`mmserve up --tls`: both services with TLS and tokens on 127.0.0.1, the CLI through them, and the
OpenAI gateway in front, reaching the decoder with TLS and the token."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from common.images import encode_png
from tests.integration.harness import ROOT, free_port
from tests.oracle import make_image


def _cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_mmserve_up_tls_serves_a_request_with_tls_and_a_token(tmp_path, tiny_model_dir):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MMSERVE_")}
    env = {**clean, "MMSERVE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    enc_port, dec_port, gw_port = free_port(), free_port(), free_port()
    log_path = tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--tls", "--model", str(tiny_model_dir),
         "--encoder-port", str(enc_port), "--decoder-port", str(dec_port), "--gateway-port", str(gw_port)],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "mmserve is up" not in log_path.read_text():
            assert up.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "mmserve up --tls did not come up"
            time.sleep(0.5)
        exports = re.search(r"export (.+)", log_path.read_text()).group(1)
        client_env = dict(pair.split("=", 1) for pair in exports.split())
        assert set(client_env) == {"MMSERVE_TLS_CA", "MMSERVE_TLS_CERT", "MMSERVE_TLS_KEY",
                                   "MMSERVE_TOKEN_FILE"}
        secured = {**env, **client_env}
        image = tmp_path / "cat.png"
        image.write_bytes(encode_png(make_image(6)))
        addr = f"127.0.0.1:{dec_port}"
        args = ("generate", "--addr", addr, "--prompt", "What is this?", "--image", str(image),
                "--max-tokens", "4", "--usage")
        gen = _cli(*args, env=secured)
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stderr.strip().splitlines()[-1])["usage"]["images"] == 1

        no_token = {k: v for k, v in secured.items() if k != "MMSERVE_TOKEN_FILE"}
        refused = _cli(*args, env=no_token)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        plaintext = _cli(*args, env=env)
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr

        enc_stats = json.loads(_cli("stats", f"127.0.0.1:{enc_port}", env=secured).stdout)
        assert enc_stats["service"] == "encoder" and enc_stats["encodes"] >= 1
        assert _cli("health", addr, env=secured).returncode == 0
        assert _cli("health", addr, env=env).returncode == 1  # plaintext cannot reach a TLS port

        # The gateway is the public edge; the decoder behind it requires TLS and a token.
        chat = httpx.post(f"http://127.0.0.1:{gw_port}/v1/chat/completions", timeout=120, json={
            "model": tiny_model_dir.name, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] >= 1
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
    assert up.returncode == 0, log_path.read_text()[-3000:]
    token = (tmp_path / "home" / "tls" / "token").read_text().strip()
    assert token not in log_path.read_text()  # tokens are never logged
