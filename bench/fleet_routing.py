"""Cache-aware against least-outstanding routing: multi-turn conversations about shared images, replayed
through the gateway over several decoders.

    python -m bench.fleet_routing --model DIR [--decoders 4] [--encoders 2] [--conversations 16]
                                  [--turns 4] [--images 4] [--rate 2] [--out routing.json]

Starts the encoders and decoders once, then one gateway per arm over them: `least-outstanding` and
`cache-aware` over every decoder, and `single` over one decoder (the hit rate one decoder reaches on the
same trace, the yardstick). Each arm replays the same trace under a cache salt of its own, so no arm
finds another's KV or embeddings. A conversation is about one of --images images (shared between
conversations); each turn repeats the whole conversation so far (the assistant's earlier answers as it
gave them) and adds a question; the next turn is sent when the answer is in, after --think seconds;
conversations start at Poisson arrivals (--rate a second). Each request names its conversation as `user`.

Reported per arm: prefix-cache hit tokens and hit rate (the decoders' counters over the arm), images
skipped by KV reuse, TTFT p50/p99 (streamed), and the hit rate as a fraction of the single decoder's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import time

import httpx

from bench.chaos import GatewayService
from bench.report import print_table, save_result
from bench.services import decoder_service, encoder_service, exit_on_sigterm, workdir
from bench.soak import noise_image
from bench.stats import clean, ratio, summarize
from bench.svcstats import decoder_stats, delta

QUESTIONS = ("What is in this picture?", "Describe the colours you see.", "Is there any text in it?",
             "What would you call this image?", "Where might it have been taken?", "Summarise it.")
COUNTERS = ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "images_skipped_by_kv_reuse",
            "images_encoded", "requests_finished")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--images", type=int, default=4, help="distinct images the conversations share")
    p.add_argument("--image-side", type=int, default=224)
    p.add_argument("--rate", type=float, default=2.0, help="conversations started a second")
    p.add_argument("--think", type=float, default=0.2, help="seconds between an answer and the next turn")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument("--arms", default="single,least-outstanding,cache-aware")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


async def conversation(client: httpx.AsyncClient, index: int, image: bytes, args: argparse.Namespace,
                       salt: str, ttfts: list[float], errors: list[str]) -> None:
    rng = random.Random(args.seed * 7919 + index)
    messages: list[dict] = []
    for turn in range(args.turns):
        content: list[dict] = [{"type": "text", "text": rng.choice(QUESTIONS)}]
        if turn == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
        messages.append({"role": "user", "content": content})
        body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "user": f"conversation-{index}"}
        t0, first, text = time.monotonic(), None, []
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"x-cache-salt": salt}) as reply:
            if reply.status_code != 200:
                errors.append(f"status {reply.status_code}")
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.monotonic()
                        text.append(piece)
        if first is not None:
            ttfts.append(first - t0)
        messages.append({"role": "assistant", "content": "".join(text)})
        await asyncio.sleep(args.think)


async def replay(gateway: str, images: list[bytes], args: argparse.Namespace, salt: str) -> dict:
    ttfts: list[float] = []
    errors: list[str] = []
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=f"http://{gateway}", timeout=300) as client:
        tasks = []
        for i in range(args.conversations):
            image = images[i % len(images)]
            tasks.append(asyncio.create_task(conversation(client, i, image, args, salt, ttfts, errors)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    return {"ttft": summarize(ttfts), "errors": errors}


def counters(addresses: list[str]) -> dict:
    total: dict = dict.fromkeys(COUNTERS, 0)
    for address in addresses:
        stats = decoder_stats(address)
        for key in COUNTERS:
            total[key] += stats[key]
    return total


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logs = workdir(args.logs)
    exit_on_sigterm()
    encoders = [encoder_service(args.model, logs, args.device, args.dtype, name=f"encoder{i}")
                for i in range(args.encoders)]
    extra = [x for e in encoders[1:] for x in ("--encoder", e.address)]
    extra += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    decoders = [decoder_service(args.model, encoders[0].address, logs, args.device, args.dtype, extra,
                                name=f"decoder{i}") for i in range(args.decoders)]
    rng = random.Random(args.seed)
    images = [noise_image(args.seed * 100 + i, args.image_side, args.image_side) for i in range(args.images)]
    results: dict = {}
    services = [*encoders, *decoders]
    try:
        for s in services:
            s.launch()
        for s in services:
            s.wait(args.start_timeout)
        addresses = [d.address for d in decoders]
        for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
            over = addresses[:1] if arm == "single" else addresses
            routing = "least-outstanding" if arm == "single" else arm
            argv = ["gateway", "--routing", routing, "--model", str(args.model),
                    "--decoder-check-interval", "1"]
            for address in over:
                argv += ["--decoder", address]
            gateway = GatewayService(f"gateway-{arm}", argv, logs / f"gateway-{arm}.log")
            gateway.launch().wait(args.start_timeout)
            try:
                before = counters(over)
                replayed = asyncio.run(replay(gateway.address, images, args, f"arm-{arm}-{rng.random()}"))
                d = delta(before, counters(over))
            finally:
                gateway.stop()
            results[arm] = {**replayed, **d,
                            "prefix_hit_rate": ratio(d["prefix_cache_hit_tokens"],
                                                     d["prefix_cache_queried_tokens"])}
    finally:
        for s in reversed(services):
            s.stop()
    single = results.get("single", {}).get("prefix_hit_rate")
    for arm in results.values():
        arm["hit_rate_vs_single"] = ratio(arm["prefix_hit_rate"] or 0.0, single) if single else None
    save_result("fleet_routing", args, clean(results))
    print_table("routing arms", ["arm", "hit tokens", "hit rate", "vs single", "images skipped",
                                 "TTFT p50 ms", "TTFT p99 ms", "errors"],
                [[name, r["prefix_cache_hit_tokens"], r["prefix_hit_rate"], r["hit_rate_vs_single"],
                  r["images_skipped_by_kv_reuse"], r["ttft"]["p50_ms"], r["ttft"]["p99_ms"], len(r["errors"])]
                 for name, r in results.items()])
    return 0 if all(not r["errors"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
