"""One image through the vision tower, in-process: ours against HF's, and where our GPU time goes.

    python -m bench.profile_tower --model /tmp/phi4mm --device cuda --dtype bfloat16 --out tower.json
    python -m bench.profile_tower --model /tmp/phi-tiny --device cpu --dtype float32 --image-size 448  (smoke)

Any family (ModelFamily.make_vision_encoder and hf_class). Ours: `encode_prepared` on an image already
through `prepare` (so device-side preprocessing is inside, the file's decode is not), at the encoder's
default --preprocess. HF: its image features (bench.hf_ref.hf_image_features) on its processor's outputs,
the processor excluded. Each the median of --reps calls after two warm-ups, synchronised; then one of our
calls under torch.profiler: its kernels by device time (ops by CPU time on a CPU).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence

import torch

from bench.hf_ref import hf_image_features, hf_image_processor
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.workload import random_png
from common.checkpoint import parse_dtype
from common.images import decode_image


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the tower profile."""
    p = argparse.ArgumentParser(prog="python -m bench.profile_tower", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--image-size", type=int, default=1024, help="side of the random square image")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip HF's tower")
    p.add_argument("--top", type=int, default=15, help="kernels to list")
    p.add_argument("--out", default=None)
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, reps: int) -> float:
    """Median wall milliseconds of fn() over reps calls (two warm-ups first), synchronised."""
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernel_table(fn, device: torch.device, top: int) -> tuple[float, list[list]]:
    """(total ms, the top entries [name, calls, ms]) of one fn() under torch.profiler: device kernels on a
    GPU (device activity only, so no op is counted twice), ops' own CPU time on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        fn()
        _sync(device)
    rows, total = [], 0.0
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total" if gpu else "self_cpu_time_total", 0.0) or 0.0
        if us > 0:
            total += us
            rows.append([ev.key[:80], ev.count, round(us / 1e3, 3)])
    rows.sort(key=lambda r: -r[2])
    return total / 1e3, rows[:top]


def profile_ours(vision, image, reps: int, top: int) -> dict:
    """Our encoder on one prepared image: median ms, device ms and kernels of one call, its rows."""
    device = vision.device
    prepared = [vision.prepare(image)]
    with torch.inference_mode():
        ours_ms = median_ms(lambda: vision.encode_prepared(prepared), device, reps)
        rows = vision.encode_prepared(prepared)[0].shape[0]
        device_ms, kernels = kernel_table(lambda: vision.encode_prepared(prepared), device, top)
    return {"rows": rows, "preprocess": vision.preprocess_mode, "ours_ms": ours_ms,
            "ours_device_ms": device_ms, "kernels": kernels}


def run(args: argparse.Namespace) -> dict:
    """Run the profile; returns the JSON payload."""
    import transformers

    from common.families.registry import family_of_model

    model_dir = resolve_model(args)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    family = family_of_model(model_dir)
    image = decode_image(random_png(3, args.image_size))
    result = {"family": family.name, "image_size": args.image_size,
              **profile_ours(family.make_vision_encoder(model_dir, device, dtype, preprocess="auto"), image,
                             args.reps, args.top)}
    gc.collect()
    if not args.no_hf:
        placement = {"device_map": str(device)} if device.type == "cuda" else {}
        model = getattr(transformers, family.hf_class).from_pretrained(
            str(model_dir), dtype=dtype, local_files_only=True, **placement).to(device).eval()
        pixels = hf_image_processor(model_dir)(images=[image], return_tensors="pt")
        with torch.inference_mode():
            result["hf_ms"] = median_ms(lambda: hf_image_features(model, pixels, device, dtype), device,
                                        args.reps)
        result["ours_over_hf"] = result["ours_ms"] / result["hf_ms"]
        del model
    print_table(f"one {args.image_size}px image through the tower ({family.name}, {args.dtype})",
                ["rows", "preprocess", "ours ms", "ours kernels ms", "HF ms", "ours / HF"],
                [[result["rows"], result["preprocess"], result["ours_ms"], result["ours_device_ms"],
                  result.get("hf_ms"), result.get("ours_over_hf")]])
    print_table("our kernels, one call", ["kernel", "calls", "ms"], result["kernels"])
    return save_result("profile_tower", args, result)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
