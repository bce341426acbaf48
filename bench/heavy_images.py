"""Text latency through the OpenAI gateway while heavy image requests run (issue 32's workload): a text
completion's time while clients send many all-black large PNGs per request without pause.

    python -m bench.heavy_images [--preset tiny] [--heavy-clients 2 --images-per-request 16 --side 4096]

The regression this measures put text requests 23.5 s behind such requests; the gateway parses large
bodies off its event loop (gateway/admission.py) and the decoder keeps text-only input in a lane of its
own (decoder_svc/input_lanes.py). Spawns an encoder, a decoder and a gateway on loopback; after one
unmeasured text request, --heavy-clients threads send the heavy chat request back to back, and after
--settle-s (the heavy requests are being decoded) --text-requests text completions are timed one after
another, --text-gap-s apart. Reports the text latencies (median, max) and every heavy request's status
(200, or 429 where admission pushed back) and latency, and when each request of either kind was answered
(seconds since the heavy load began: text requests answered before the first heavy one were not kept
waiting behind the images). A black PNG is about 50 kB per 4096² image: cheap
to send, 48 MiB decoded. Every image sent is a new file (the same pixels, a text chunk numbering it), so
no cache keyed by the file's content spares its decode.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence

import httpx
from PIL import Image

from bench.gateway_latency import GatewayProcess
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import Pair
from common.images import encode_png


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the heavy-image benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.heavy_images", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--heavy-clients", type=int, default=2)
    p.add_argument("--images-per-request", type=int, default=16)
    p.add_argument("--side", type=int, default=4096, help="the PNGs' width and height")
    p.add_argument("--text-requests", type=int, default=6)
    p.add_argument("--settle-s", type=float, default=2.0, help="heavy load before the first text request")
    p.add_argument("--text-gap-s", type=float, default=0.3)
    p.add_argument("--out", default=None)
    return p


def numbered_png(png: bytes, number: int) -> bytes:
    """The PNG with a tEXt chunk ("n" = number) after its header chunk: other bytes, the same pixels."""
    data = b"n\x00" + str(number).encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    header_end = 8 + 8 + 13 + 4  # signature, IHDR's length and type, its 13 bytes, its CRC
    return png[:header_end] + chunk + png[header_end:]


def heavy_bodies(images: int, side: int) -> Iterator[dict]:
    """Heavy chat requests, each `images` new all-black side x side PNGs as data URLs and one question."""
    black = encode_png(Image.new("RGB", (side, side)))
    numbers = itertools.count()
    while True:
        urls = ["data:image/png;base64," + base64.b64encode(numbered_png(black, next(numbers))).decode()
                for _ in range(images)]
        yield {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": url}} for url in urls),
            {"type": "text", "text": "what?"}]}]}


TEXT_BODY = {"model": "bench", "prompt": "USER: hi ASSISTANT:", "max_tokens": 2}


def measure(url: str, args: argparse.Namespace) -> dict:
    """Text latencies under the heavy load of one running gateway at `url`."""
    bodies = heavy_bodies(args.images_per_request, args.side)
    lock = threading.Lock()
    heavy: list[tuple[int, float, float]] = []  # (status, latency, done at: seconds since the load began)
    stop = threading.Event()
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post("/v1/completions", json=TEXT_BODY).raise_for_status()  # unmeasured

        began = time.perf_counter()

        def send_heavy() -> None:
            while not stop.is_set():
                with lock:
                    body = next(bodies)
                started = time.perf_counter()
                status = client.post("/v1/chat/completions", json=body).status_code
                done = time.perf_counter()
                heavy.append((status, done - started, done - began))

        threads = [threading.Thread(target=send_heavy, daemon=True) for _ in range(args.heavy_clients)]
        for t in threads:
            t.start()
        time.sleep(args.settle_s)
        text: list[tuple[int, float, float]] = []
        for _ in range(args.text_requests):
            started = time.perf_counter()
            status = client.post("/v1/completions", json=TEXT_BODY).status_code
            done = time.perf_counter()
            text.append((status, done - started, done - began))
            time.sleep(args.text_gap_s)
        stop.set()
        for t in threads:
            t.join(600)
    latencies = [t[1] for t in text]
    return {"text_statuses": [t[0] for t in text], "text_latency_s": latencies,
            "text_median_s": statistics.median(latencies), "text_max_s": max(latencies),
            "text_done_s": [t[2] for t in text], "heavy_statuses": [h[0] for h in heavy],
            "heavy_latency_s": [h[1] for h in heavy], "heavy_done_s": [h[2] for h in heavy]}


def run(args: argparse.Namespace) -> dict:
    """Spawn the services, measure, stop them; returns the JSON payload."""
    model = resolve_model(args)
    pair = Pair(model, args.device, args.dtype, decoder_args=["--num-kv-blocks", "512"]).start()
    gateway = None
    try:
        gateway = GatewayProcess(pair.decoder.address, model, pair.logs)
        result = measure(gateway.url, args)
    finally:
        if gateway is not None:
            gateway.stop()
        pair.stop()
    pairs = zip(result["heavy_statuses"], result["heavy_latency_s"], strict=True)
    ok_heavy = [s for c, s in pairs if c == 200]
    load = f"{args.heavy_clients} x {args.images_per_request} x {args.side}²"
    print_table(f"text latency under {load} image load",
                ["text median s", "text max s", "heavy requests", "heavy 200 median s"],
                [[result["text_median_s"], result["text_max_s"], len(result["heavy_statuses"]),
                  statistics.median(ok_heavy) if ok_heavy else None]])
    return save_result("heavy_images", args, result)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
