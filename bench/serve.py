"""`mmserve bench` / `python -m bench.serve`: a load generator against the decoder service.

    python -m bench.serve --spawn --model DIR --num-requests 64 --concurrency 16 --repeat-ratio 0.5 \\
        --out bench-serve.json --plot bench-serve.png
    python -m bench.serve --addr 127.0.0.1:50052 --encoder 127.0.0.1:50051 --request-rate 4

Reports throughput (requests/s, output tokens/s), TTFT/TPOT/ITL/E2E (mean, p50, p99), the decoder's
prefix-cache hit rate and images skipped by KV reuse (stats delta over the measured window) and, with
--encoder, the encoder's embedding-cache hit rate. `--prompt-len` counts text tokens; each image adds
its image tokens on top.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from bench.loadgen import LoadConfig, latency_samples, run_load, summarize_records
from bench.plot import plot_cdfs
from bench.report import environment, latency_rows, print_table, write_json
from bench.svcstats import StatsWindow
from bench.targets import add_target_args, model_dir, target
from bench.workload import BenchRequest, PromptMaker, build_requests


def build_arg_parser() -> argparse.ArgumentParser:
    """The load generator's options."""
    p = argparse.ArgumentParser(prog="mmserve bench", description=__doc__.split("\n")[0])
    add_target_args(p, default_addr="127.0.0.1:50052")
    p.add_argument("--spawn", action="store_true", help="start an encoder+decoder pair on --model/--preset")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once, capped by --concurrency)")
    p.add_argument("--repeat-ratio", type=float, default=0.5, help="fraction of requests reusing an image")
    p.add_argument("--image-size", type=int, default=64, help="side of the random PNGs, pixels")
    p.add_argument("--no-images", action="store_true", help="text-only requests")
    p.add_argument("--prompt-len", type=int, default=64, help="text tokens per prompt (images add more)")
    p.add_argument("--shared-len", type=int, default=32,
                   help="tokens of a fixed instruction after the image, the same in every request")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore_eos, so every request makes --output-len tokens)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (own images) before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--cache-salt", default="")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--plot", default=None, help="PNG of latency CDFs")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


async def measure(decoder: str, encoder: str | None, requests: Sequence[BenchRequest], cfg: LoadConfig,
                  warmup: Sequence[BenchRequest] = (), progress: bool = True,
                  desc: str = "bench") -> tuple[dict, dict[str, list[float]]]:
    """Warm up, then run `requests` under a stats window; returns (summary, raw latency samples)."""
    if warmup:
        await run_load(decoder, warmup, cfg, progress=False)
    window = StatsWindow(decoder, encoder)
    records, duration = await run_load(decoder, requests, cfg, progress=progress, desc=desc)
    summary = summarize_records(records, duration)
    summary["cache"] = window.close()
    summary["repeat_requests"] = sum(r.repeat for r in requests)
    return summary, latency_samples(records)


def print_summary(title: str, s: dict) -> None:
    """The latency table and the throughput/cache table of one run."""
    print_table(f"{title}: latency (ms)", ["metric", "mean", "p50", "p99"], latency_rows(s))
    c = s.get("cache", {})
    rows = [["requests ok / failed", f"{s['completed']} / {s['failed']}"],
            ["duration s", s["duration_s"]],
            ["requests/s", s["request_throughput_rps"]],
            ["output tokens/s", s["output_token_throughput_tps"]],
            ["mean prompt tokens", s["mean_prompt_tokens"]],
            ["prefix-cache hit rate (tokens)", c.get("prefix_cache_hit_rate")],
            ["encoder-cache hit rate", c.get("encoder_cache_hit_rate", "n/a (no --encoder)")],
            ["images skipped by KV reuse", c.get("images_skipped_by_kv_reuse")]]
    print_table(f"{title}: throughput and caches", ["figure", "value"], rows)


async def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by args; returns the JSON payload."""
    prompts = PromptMaker(model_dir(args, args.spawn), seed=args.seed)
    requests = build_requests(args.num_requests, args.repeat_ratio, args.prompt_len, prompts,
                              args.image_size, seed=args.seed, with_images=not args.no_images,
                              shared_len=args.shared_len)
    warmup = build_requests(args.warmup, 0.0, args.prompt_len, prompts, args.image_size,
                            seed=args.seed + 7919, with_images=not args.no_images,
                            shared_len=args.shared_len) if args.warmup else []
    cfg = LoadConfig(concurrency=args.concurrency, request_rate=args.request_rate,
                     output_len=args.output_len, ignore_eos=args.ignore_eos, timeout=args.timeout,
                     cache_salt=args.cache_salt, seed=args.seed)
    with target(args, args.spawn) as (decoder, encoder):
        summary, samples = await measure(decoder, encoder, requests, cfg, warmup, args.progress)
    config = {k: v for k, v in vars(args).items() if k not in ("progress",)}
    payload = {"benchmark": "serve", "env": environment(args.device), "config": config, "results": summary}
    print_summary("mmserve bench", summary)
    write_json(args.out, payload)
    if args.plot:
        payload["plot_backend"] = plot_cdfs({m: {"serve": v} for m, v in samples.items()}, args.plot,
                                            title=f"mmserve bench: {args.num_requests} requests")
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv, run, exit 1 when any request failed."""
    args = build_arg_parser().parse_args(argv)
    payload = asyncio.run(run(args))
    return 1 if payload["results"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
