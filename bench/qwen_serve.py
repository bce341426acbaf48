"""Qwen2.5-VL or Qwen3-VL through the services: encoder throughput at rising concurrency, and lookahead.

    python -m bench.qwen_serve --model DIR [--device cuda --dtype bfloat16] [--out qwen_serve.json]

The family follows the checkpoint (bench.qwen_gpu.family_of): results saved as benchmark `qwen_serve`
with headline rows "qwen ..." for Qwen2.5-VL, `qwen3_serve` and "qwen3 ..." for Qwen3-VL (whose encoder
hands over [parts, rows, hidden] per image: the merged features and the DeepStack levels).

Spawns one encoder and two decoders on it (`--encoder-max-ahead 4` and `0`, few running requests
each, so that requests queue and lookahead has something to act on).
- Encode: --images distinct --image-size PNGs (always cache misses) from 1 and --concurrency clients
  over gRPC, CUDA IPC refs released at once (inline bytes on a CPU): images per second, the image
  processor and decode included (bench/encode_tput.py's loop).
- Lookahead: --requests requests (all at once, or one every --arrival-interval s), each with 1 to 4
  distinct images of --image-size (a new cache salt per run: every image misses), the same requests to
  the decoder with lookahead and to the one without; mean and p50/p90 time to the first token, the
  ratio, and each decoder's lookahead counters.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid

from bench.encode_tput import _encode_level, make_pngs
from bench.qwen_gpu import END, IMAGE, USER, family_of
from bench.report import save_result
from bench.services import decoder_service, encoder_service, start_all, workdir
from common.client import AsyncDecoderClient, DecoderClient
from common.pb import common_pb2

LOOKAHEAD_STATS = ("images_prefetched", "lookahead_ready_at_prefill", "lookahead_waited_at_prefill",
                   "lookahead_boosted", "images_encoded")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the service-level Qwen2.5-VL / Qwen3-VL benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.qwen_serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--images", type=int, default=128, help="distinct images per Encode level")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=24, help="requests of the lookahead run")
    p.add_argument("--max-num-seqs", type=int, default=2, help="running requests per decoder")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--arrival-interval", type=float, default=0.0,
                   help="seconds between the lookahead run's requests (0: all at once)")
    p.add_argument("--no-encode", action="store_true", help="only the lookahead part")
    p.add_argument("--no-lookahead", action="store_true", help="only the Encode part (no decoders)")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


async def _one(client: AsyncDecoderClient, prompt: str, pngs: list[bytes], salt: str, n: int,
               delay: float = 0.0) -> float:
    """Seconds to the first token of one streamed request, sent after `delay` seconds."""
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    first = None
    async for chunk in client.generate(prompt, pngs, max_tokens=n, ignore_eos=True, cache_salt=salt):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def ttft_run(address: str, jobs: list[tuple[str, list[bytes]]], n: int,
                   interval: float = 0.0) -> list[float]:
    """Job i sent at i * interval (0: all at once) on one channel; their TTFTs in job order."""
    salt = uuid.uuid4().hex[:16]  # a fresh salt: every image misses the encoder cache
    async with AsyncDecoderClient(address, timeout=600) as client:
        return list(await asyncio.gather(*(_one(client, p, imgs, salt, n, i * interval)
                                           for i, (p, imgs) in enumerate(jobs))))


def summary(values: list[float]) -> dict:
    """mean, p50, p90 in ms."""
    ms = sorted(v * 1000 for v in values)
    return {"mean_ms": round(statistics.fmean(ms), 1), "p50_ms": round(ms[len(ms) // 2], 1),
            "p90_ms": round(ms[int(len(ms) * 0.9)], 1)}


def main(argv: list[str] | None = None) -> int:
    """Spawn the services, run both parts, print and save the JSON."""
    args = build_arg_parser().parse_args(argv)
    logs = workdir(args.logs)
    dec_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "8192",
                "--encoder-timeout", "300"]
    if args.device == "cuda":
        dec_args += ["--kv-cache-bytes", str(8 << 30)]
    enc = encoder_service(args.model, logs, args.device, args.dtype, ["--cache-bytes", str(8 << 30)])
    on = decoder_service(args.model, enc.address, logs, args.device, args.dtype,
                         dec_args + ["--encoder-max-ahead", "4"], name="decoder-on")
    off = decoder_service(args.model, enc.address, logs, args.device, args.dtype,
                          dec_args + ["--encoder-max-ahead", "0"], name="decoder-off")
    services = [enc] if args.no_lookahead else [enc, on, off]
    result: dict = {"model": args.model, "family": family_of(args.model)[0], "device": args.device,
                    "dtype": args.dtype, "image_size": args.image_size}
    try:
        start_all(services)
        accept = [common_pb2.TRANSPORT_CUDA_IPC if args.device == "cuda" else common_pb2.TRANSPORT_INLINE]
        levels = {}
        for c in () if args.no_encode else (1, args.concurrency):
            pngs = make_pngs(args.images if c > 1 else max(8, args.images // 8), args.image_size, 1000 + c)
            levels[c] = asyncio.run(_encode_level(enc.address, pngs, c, accept, channels=min(c, 8)))
            print(f"encode c={c}: {levels[c]['images_per_s']:.1f} img/s "
                  f"(steady {levels[c]['steady_images_per_s']})", flush=True)
        result["encode"] = {str(c): {k: levels[c][k] for k in ("images_per_s", "steady_images_per_s",
                                                               "latency")} for c in levels}
        if args.no_lookahead:
            return _finish(args, result)
        rng = random.Random(0)
        jobs = []
        for i in range(args.requests):
            count = rng.randint(1, 4)
            pngs = make_pngs(count, args.image_size, 5000 + 10 * i)
            jobs.append((USER + IMAGE * count + f"request {i}: compare these pictures" + END, pngs))
        asyncio.run(ttft_run(on.address, jobs[:2], args.output_len))  # warm both paths once
        asyncio.run(ttft_run(off.address, jobs[:2], args.output_len))
        gap = args.arrival_interval
        ttft = {"on": summary(asyncio.run(ttft_run(on.address, jobs, args.output_len, gap))),
                "off": summary(asyncio.run(ttft_run(off.address, jobs, args.output_len, gap)))}
        for name, svc in (("on", on), ("off", off)):  # what lookahead did (counters since start)
            with DecoderClient(svc.address, timeout=30) as client:
                stats = client.stats()
            ttft[f"{name}_stats"] = {f: getattr(stats, f) for f in LOOKAHEAD_STATS}
        ttft["mean_on_over_off"] = round(ttft["on"]["mean_ms"] / ttft["off"]["mean_ms"], 3)
        result["lookahead"] = ttft
        print("lookahead", ttft, flush=True)
    finally:
        for s in services:
            s.stop()
    return _finish(args, result)


def _finish(args: argparse.Namespace, result: dict) -> int:
    """Add the headline, print and save."""
    c = str(args.concurrency)
    label = result["family"]
    result["headline"] = []
    if c in result.get("encode", {}):
        result["headline"].append([f"{label} Encode img/s at {c} clients ({args.image_size}px)",
                                   round(result["encode"][c]["images_per_s"], 1)])
    if "lookahead" in result:
        ratio = result["lookahead"]["mean_on_over_off"]
        result["headline"].append([f"{label} lookahead mean TTFT on/off", ratio])
    save_result(f"{label}_serve", args, result, headline=result["headline"])
    print(result["headline"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
