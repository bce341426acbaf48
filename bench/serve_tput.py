"""Serving throughput at 64 concurrent requests, one image each, half of them repeats, vs HF batched
`generate` on the same prompts and images.

    python -m bench.serve_tput --model DIR [--device cuda --dtype bfloat16] [--out serve_tput.json]
    python -m bench.serve_tput --addr 127.0.0.1:50052 --encoder 127.0.0.1:50051 --model DIR

Served: all requests at once over gRPC (the load generator of bench.serve), exactly --output-len tokens
each. HF: the same prompts and images through the processor and `generate` in batches of --hf-batch,
timed from PNG bytes to tokens. HF runs after the served run, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import time
from collections.abc import Sequence

from PIL import Image

from bench.hf_ref import image_inputs, load_hf, timed_generate
from bench.loadgen import LoadConfig
from bench.report import print_table, save_result
from bench.roofline import Workload, distinct, measure_roofline, patches_per_image
from bench.serve import measure, print_summary
from bench.stats import ratio
from bench.targets import add_target_args, model_dir, target
from bench.workload import PromptMaker, build_requests


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the serving-throughput benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.serve_tput", description=__doc__.split("\n")[0])
    add_target_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeat-ratio", type=float, default=0.5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--shared-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--hf-batch", type=int, default=64, help="HF generate batch size")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--name", default="serve_tput", help="the benchmark's name in the JSON (and bench.merge)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def hf_throughput(model, device: str, dtype: str, requests, output_len: int, batch: int) -> dict:
    """Output tokens/s and requests/s of HF batched generate over the same requests."""
    hf, processor = load_hf(model, device, dtype)
    first = requests[:min(batch, len(requests))]
    images = [Image.open(io.BytesIO(r.image)).convert("RGB") for r in first[:2]]
    timed_generate(hf, image_inputs(hf, processor, [r.prompt for r in first[:2]], images, device), 2)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        images = [Image.open(io.BytesIO(r.image)).convert("RGB") for r in chunk]
        inputs = image_inputs(hf, processor, [r.prompt for r in chunk], images, device)
        tokens += timed_generate(hf, inputs, output_len)[1]
    seconds = time.perf_counter() - t0
    del hf
    gc.collect()
    return {"duration_s": seconds, "output_token_throughput_tps": tokens / seconds,
            "request_throughput_rps": len(requests) / seconds, "total_output_tokens": tokens,
            "batch": batch}


def served_roofline(args: argparse.Namespace, model, requests, served: dict) -> dict | None:
    """The run's wall time against the roofline of the same work (bench/roofline.py), with TTFT p99."""
    if not served["completed"]:
        return None
    images = [r.image for r in requests if r.image]
    work = Workload(requests=served["completed"], mean_prompt_tokens=served["mean_prompt_tokens"],
                    output_len=args.output_len, concurrency=args.concurrency,
                    distinct_images=distinct(images),
                    patches_per_image=patches_per_image(model, args.image_size) if images else 0)
    bound = measure_roofline(model, args.device, args.dtype, work, served["duration_s"])
    bound["ttft_p99_ms"] = served["ttft"]["p99_ms"]
    print_table("against the roofline", ["figure", "value"], [
        ["roofline s (compute + memory)", f"{bound['roofline_s']:.3f} ({bound['compute_s']:.3f} + "
                                          f"{bound['memory_s']:.3f})"],
        ["peak FLOP/s", f"{bound['peak_flops']:.3g} ({bound['peak_source']})"],
        ["copy bandwidth GB/s", f"{bound['bandwidth_bytes_s'] / 1e9:.1f}"],
        ["wall s", f"{bound['wall_s']:.3f}"],
        ["wall / roofline", f"{bound['wall_over_roofline']:.2f}"],
        ["TTFT p99 ms", f"{bound['ttft_p99_ms']:.1f}"]])
    return bound


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    spawning = args.addr is None
    model = model_dir(args, spawning)
    prompts = PromptMaker(model, seed=args.seed)
    requests = build_requests(args.num_requests, args.repeat_ratio, args.prompt_len, prompts,
                              args.image_size, seed=args.seed, shared_len=args.shared_len)
    warmup = build_requests(2, 0.0, args.prompt_len, prompts, args.image_size, seed=args.seed + 99,
                            shared_len=args.shared_len)
    cfg = LoadConfig(concurrency=args.concurrency, output_len=args.output_len, ignore_eos=True)
    with target(args, spawning) as (decoder, encoder):
        served, _ = asyncio.run(measure(decoder, encoder, requests, cfg, warmup, args.progress,
                                        desc="serve_tput"))
    print_summary(f"served ({args.num_requests} req, conc. {args.concurrency})", served)
    bound = served_roofline(args, model, requests, served) if model is not None else None
    hf = None
    if not args.no_hf and model is not None:
        hf = hf_throughput(model, args.device, args.dtype, requests, args.output_len, args.hf_batch)
    results = {"served": served, "hf_generate": hf, "roofline": bound,
               "served_over_hf_output_tps": ratio(served["output_token_throughput_tps"] or 0.0,
                                                  hf["output_token_throughput_tps"]) if hf else None}
    rows = [["mmserve", served["output_token_throughput_tps"], served["request_throughput_rps"],
             served["duration_s"]]]
    if hf:
        rows.append([f"HF generate (batch {hf['batch']})", hf["output_token_throughput_tps"],
                     hf["request_throughput_rps"], hf["duration_s"]])
    print_table("serving throughput", ["system", "output tokens/s", "requests/s", "seconds"], rows)
    label = args.name.removeprefix("serve_tput").strip("_") or "64 conc."
    own = [[f"serve {label}: output tok/s", served["output_token_throughput_tps"]],
           [f"serve {label}: TTFT p99 ms", served["ttft"]["p99_ms"]]]
    if bound:
        own.append([f"serve {label}: wall / roofline", bound["wall_over_roofline"]])
    return save_result(args.name, args, results, headline=own)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    payload = run(build_arg_parser().parse_args(argv))
    return 1 if payload["results"]["served"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
