"""How long the gateway takes to refuse a million empty chat messages (a 30 MB body of small JSON objects:
413 at its bound on JSON values, issue 32 asked for under 1 s over loopback). The test
(tests/gateway/test_public_edge.py) bounds the work (values parsed, bytes allocated); this measures the
time, which depends on the machine and is asserted by no test.

    python -m bench.experiments.empty_messages --rounds 5

The gateway is spawned over a decoder address that nothing listens on: the body is refused before any
decoder is called.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.startup import free_port

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = b'{"role":"user","content":""}'


def main(argv: list[str] | None = None) -> None:
    """Spawn a gateway, time `--rounds` refusals of the body (after one untimed), print them."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.empty_messages",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    body = b'{"model":"fake","messages":[' + b",".join([MESSAGE] * 1_000_000) + b"]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv_ = [sys.executable, "-m", "common.cli", "gateway", "--port", str(port), "--served-model-name",
             "fake", "--decoder", f"127.0.0.1:{free_port()}", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "MMSERVE_API_KEY"}
    log = Path(tempfile.mkdtemp(prefix="bench-empty-")) / "gateway.log"
    proc = subprocess.Popen(argv_, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:  # listening once it answers at all (no decoder: not healthy)
                try:
                    client.get("/v1/models")
                    break
                except httpx.TransportError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the gateway did not start; log: {log}") from None
                    time.sleep(0.2)
            times = []
            for i in range(args.rounds + 1):
                started = time.perf_counter()
                reply = client.post("/v1/chat/completions", content=body,
                                    headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - started
                if reply.status_code != 413 or "JSON objects" not in reply.text:
                    raise SystemExit(f"expected 413, got {reply.status_code}: {reply.text[:300]}")
                if i:  # the first round warms the connection and the parser thread
                    times.append(elapsed)
        print(f"1M empty messages ({len(body) / 2**20:.1f} MiB) refused with 413: "
              f"median {statistics.median(times):.3f} s, max {max(times):.3f} s over {len(times)} rounds")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
