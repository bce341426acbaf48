"""A valid heavy image is answered, not refused with 503 (issue 63, CPU, qwen2.5-vl-tiny): one all-black
PNG whose Encode takes longer than the encoder's lease TTL and than the decoder's unreachable-encoder
deadline, through the gateway. Before the fix its answer was thrown away (the lease looked lapsed) and the
retry reused a deadline already past: 503 "no decoder is available now; retry later". The services run
with a short TTL and deadline (3 s) so that a 2048x2048 image (about 9 s of tower on a 2-core VM)
shows what a 4096x4096 one (over a minute) did under the defaults.

    PYTHONPATH=. python -m pytest -s tests/gateway/test_heavy_image_served.py   # prints the figures
    HEAVY_SIDE=4096 HEAVY_TIMEOUTS=60 PYTHONPATH=. python -m pytest -s \
        tests/gateway/test_heavy_image_served.py
      (the issue's image under the default TTL; its own tower time decides whether the old code failed)
"""

from __future__ import annotations

import base64
import os
import time

import httpx
from PIL import Image

from common.images import encode_png
from tests.gateway.harness import GatewayProcess
from tests.integration.harness import Pair

SIDE = int(os.environ.get("HEAVY_SIDE", "2048"))
TIMEOUT_S = os.environ.get("HEAVY_TIMEOUTS", "3")  # the encoder's --lease-ttl, decoder's --encoder-timeout


def test_an_image_slower_than_the_lease_is_answered(qwen_model_dir, tmp_path):
    black = encode_png(Image.new("RGB", (SIDE, SIDE)))
    url = "data:image/png;base64," + base64.b64encode(black).decode()
    body = {"model": "qwen", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]}]}
    pair = Pair(qwen_model_dir, tmp_path, encoder_args=["--lease-ttl", TIMEOUT_S, "--decode-processes", "0"],
                decoder_args=["--encoder-timeout", TIMEOUT_S, "--num-kv-blocks", "2048"]).start()
    gw = GatewayProcess([pair.decoder.address], tmp_path / "gateway.log", ["--served-model-name", "qwen"])
    try:
        gw.start()
        with pair.encoder_client() as enc:
            before = enc.stats().encodes
        with httpx.Client(base_url=gw.url, timeout=600) as client:
            started = time.perf_counter()
            reply = client.post("/v1/chat/completions", json=body)
            took = time.perf_counter() - started
        with pair.encoder_client() as enc:
            encodes = enc.stats().encodes - before
        print(f"\n{SIDE}x{SIDE} black PNG, lease TTL and encoder timeout {TIMEOUT_S} s: HTTP "
              f"{reply.status_code} in {took:.1f} s, {encodes} images through the tower; {reply.text[:160]}")
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None
        assert encodes == 1  # the slow Encode's answer was used, not thrown away and asked for again
    finally:
        gw.stop()
        pair.stop()
