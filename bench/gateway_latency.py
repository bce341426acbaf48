"""What the OpenAI gateway adds to time to first token: p50 TTFT through the gateway (HTTP, SSE) vs
straight to the decoder (gRPC), the same chat request each way, one at a time, side by side.

    python -m bench.gateway_latency --preset llava-1.5-7b --device cuda --dtype bfloat16 --out gw.json
    python -m bench.gateway_latency --addr 127.0.0.1:50052 --gateway http://127.0.0.1:8000 --model DIR

Without --addr it spawns a pair on the model, and without --gateway a gateway over that decoder. Cases:
`warm`: the identical request again (its prefix is in the KV cache and the image is skipped: the
decoder's part is as small as it gets, so the gateway's share shows most); `cold`: a new image each
time (the gateway also decodes the image's base64 data URL). Each round sends every case both ways,
alternating which goes first. TTFT is measured at the client, from sending the request to the first
message carrying a token (gRPC) or the first SSE event after the role chunk (gateway; max_tokens 1,
ignore_eos, so that event is the token's or its finish).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.report import print_table, save_result
from bench.services import ROOT, exit_on_sigterm, free_port
from bench.stats import summarize
from bench.targets import add_target_args, model_dir, target
from bench.workload import PromptMaker, random_png
from common.client import DecoderClient
from gateway.health import wait_until_http_healthy

CASES = ("warm", "cold")
ROUTES = ("grpc", "gateway")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the gateway latency benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.gateway_latency", description=__doc__.split("\n")[0])
    add_target_args(p)
    p.add_argument("--gateway", default=None,
                   help="a running gateway's base URL (default: spawn one over the decoder)")
    p.add_argument("--api-key", default=None, help="the gateway's API key, if it has one")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--prompt-len", type=int, default=64, help="text tokens after the image")
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p


class GatewayProcess:
    """`mmserve gateway` spawned over one decoder, healthy before use."""

    def __init__(self, decoder: str, model: Path | None, logs: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "common.cli", "gateway", "--decoder", decoder, "--port", str(self.port),
                "--served-model-name", "bench", "--log-level", "warning"]
        if model is not None:
            argv += ["--model", str(model)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.pop("MMSERVE_API_KEY", None)
        self.log = logs / "gateway.log"
        self.proc = subprocess.Popen(argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=env)
        if not wait_until_http_healthy(f"{self.url}/health", 120, is_alive=lambda: self.proc.poll() is None):
            self.stop()
            raise RuntimeError(f"the gateway did not become healthy; log:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def grpc_ttft(client: DecoderClient, text: str, png: bytes) -> float:
    """Seconds to the first message carrying a token, for a 1-token chat generation over gRPC."""
    t0 = time.perf_counter()
    first = None
    chat = [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": text}]}]
    for chunk in client.generate(chat=chat, max_tokens=1, ignore_eos=True, temperature=0.0):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the decoder returned no token")
    return first


def gateway_ttft(http: httpx.Client, model: str, text: str, png: bytes) -> float:
    """Seconds to the first SSE event after the role chunk, for the same request through the gateway.
    The body is encoded before the clock starts (as the gRPC request's bytes are built, nearly free)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = json.dumps({"model": model, "stream": True, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": url}},
                           {"type": "text", "text": text}]}]}).encode()
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/chat/completions", content=body,
                     headers={"Content-Type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"gateway: HTTP {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            if first is None and choices[0].get("delta", {}).get("role") is None:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the gateway streamed no token")
    return first


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    exit_on_sigterm()
    spawning = args.addr is None
    model = model_dir(args, spawning or args.gateway is None)
    prompts = PromptMaker(model, seed=args.seed)
    samples = {route: {case: [] for case in CASES} for route in ROUTES}
    image_seed = args.seed * 1_000_003 + 4242
    with target(args, spawning) as (decoder, _):
        gateway = None if args.gateway else GatewayProcess(
            decoder, model, Path(args.logs) if args.logs else Path(os.environ.get("TMPDIR", "/tmp")))
        base = args.gateway or gateway.url
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            with DecoderClient(decoder, timeout=600) as client, \
                    httpx.Client(base_url=base, headers=headers, timeout=600) as http:
                served = http.get("/v1/models").json()["data"][0]["id"]
                warm_text, warm_png = prompts.text(args.prompt_len), random_png(image_seed, args.image_size)
                calls = {"grpc": lambda t, p: grpc_ttft(client, t, p),
                         "gateway": lambda t, p: gateway_ttft(http, served, t, p)}
                for r in range(args.warmup + args.rounds):
                    order = ROUTES if r % 2 == 0 else ROUTES[::-1]
                    for route in order:
                        warm = calls[route](warm_text, warm_png)
                        image_seed += 1  # every cold request gets an image nobody has seen
                        new_png = random_png(image_seed, args.image_size)
                        cold = calls[route](prompts.text(args.prompt_len), new_png)
                        if r >= args.warmup:
                            samples[route]["warm"].append(warm)
                            samples[route]["cold"].append(cold)
        finally:
            if gateway is not None:
                gateway.stop()
    results: dict = {route: {case: summarize(samples[route][case]) for case in CASES} for route in ROUTES}
    results["gateway_added_p50_ms"] = {
        case: results["gateway"][case]["p50_ms"] - results["grpc"][case]["p50_ms"] for case in CASES}
    print_table("TTFT, one image + text, one request at a time (ms)",
                ["case", "gRPC p50", "gateway p50", "added p50", "gRPC p99", "gateway p99", "n"],
                [[c, results["grpc"][c]["p50_ms"], results["gateway"][c]["p50_ms"],
                  results["gateway_added_p50_ms"][c], results["grpc"][c]["p99_ms"],
                  results["gateway"][c]["p99_ms"], results["grpc"][c]["n"]] for c in CASES])
    payload = save_result("gateway_latency", args, results)
    print(json.dumps(payload["results"], indent=2))
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
