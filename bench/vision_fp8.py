"""Where an FP8 vision tower's time goes (issue 64): each linear layer's product at the tower's row count in
bf16 and in FP8 (the per-token quantization of the activations, `torch._scaled_mm`, and both together), and
the top device kernels of one forward of the bf16 and of the FP8 tower (eager fast path, no graphs).

    python -m bench.vision_fp8 --model /tmp/vision-qwen3-vl-8b --images 8 --out fp8.json     (CUDA only)

TFLOP/s count 2 * rows * in * out per product. Make the checkpoint with `mmserve make-model --preset
qwen3-vl-8b --weights vision`.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from bench.report import print_table, save_result
from bench.vision_path import noise_images
from common.image_geometry import PixelRange
from common.vision.encoders import make_vision_encoder


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.vision_fp8", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen2.5-VL or Qwen3-VL checkpoint (vision weights)")
    p.add_argument("--images", type=int, default=8, help="images per forward (1024x1024 noise)")
    p.add_argument("--max-blocks", type=int, default=1280, help="max_pixels in merge blocks")
    p.add_argument("--out", default=None)
    return p


def _ms(fn, rounds: int = 20) -> float:
    """Milliseconds per fn() between CUDA events, after two warm-ups."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / rounds


def product_figures(tower: nn.Module, rows_per_image: dict[str, int], images: int) -> list[dict]:
    """bf16 vs FP8 for each distinct linear shape of the tower (at its own row count: a merger sees a
    quarter of the patches)."""
    from common.kernels.fp8_layout import quantize_per_channel
    from common.kernels.fp8_linear import quantize_rows_fp8, scaled_mm_fp8

    shapes: dict[tuple[int, int, int], list[str]] = {}
    for name, module in tower.named_modules():
        if isinstance(module, nn.Linear) and not name.startswith("patch_embed"):
            kind = "merger" if "merger" in name else "block"
            rows = rows_per_image[kind] * images
            shapes.setdefault((rows, module.in_features, module.out_features), []).append(name)
    out = []
    for (m, k, n), names in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        q, scale = quantize_per_channel(w)
        xq, xs = quantize_rows_fp8(x)
        flops = 2 * m * k * n
        row = {"rows": m, "in": k, "out": n, "layers": len(names), "example": names[0],
               "bf16_ms": _ms(lambda x=x, w=w, bias=bias: torch.nn.functional.linear(x, w, bias)),
               "quantize_ms": _ms(lambda x=x: quantize_rows_fp8(x)),
               "scaled_mm_ms": _ms(lambda xq=xq, xs=xs, q=q, scale=scale, bias=bias: torch._scaled_mm(
                   xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), bias=bias, out_dtype=torch.bfloat16)),
               "fp8_ms": _ms(lambda x=x, q=q, scale=scale, bias=bias: scaled_mm_fp8(x, q, scale, bias))}
        if any(name.endswith("mlp.linear_fc1") for name in names):  # Qwen3-VL's fc1, then tanh GELU
            row["bf16_then_gelu_ms"] = _ms(lambda x=x, w=w, bias=bias: torch.nn.functional.gelu(
                torch.nn.functional.linear(x, w, bias), approximate="tanh"))
            row["bf16_gelu_epilogue_ms"] = _ms(lambda x=x, w=w, bias=bias: torch._addmm_activation(
                bias, x, w.t(), use_gelu=True))
            print(f"  fc1 then GELU {row['bf16_then_gelu_ms']:.3f} ms; with cuBLASLt's GELU epilogue "
                  f"{row['bf16_gelu_epilogue_ms']:.3f} ms", flush=True)
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        row["scaled_mm_tflops"] = flops / row["scaled_mm_ms"] / 1e9
        out.append(row)
    print_table("linear products, bf16 vs FP8 (ms; TFLOP/s)",
                ["rows", "in", "out", "layers", "bf16", "quantize", "scaled_mm", "fp8 total", "bf16 TF/s",
                 "fp8 mm TF/s"],
                [[r["rows"], r["in"], r["out"], r["layers"], f"{r['bf16_ms']:.3f}", f"{r['quantize_ms']:.3f}",
                  f"{r['scaled_mm_ms']:.3f}", f"{r['fp8_ms']:.3f}", f"{r['bf16_tflops']:.0f}",
                  f"{r['scaled_mm_tflops']:.0f}"] for r in out])
    keys = ("bf16_ms", "quantize_ms", "scaled_mm_ms", "fp8_ms")
    total = {key: sum(r[key] * r["layers"] for r in out) for key in keys}
    print(f"  every layer once, {images} images: bf16 {total['bf16_ms']:.2f} ms, FP8 {total['fp8_ms']:.2f} "
          f"ms (quantize {total['quantize_ms']:.2f} + scaled_mm {total['scaled_mm_ms']:.2f})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    enc = make_vision_encoder(args.model, torch.device("cuda"), torch.bfloat16)
    block = enc.layout.patch_size * enc.layout.merge_size
    pixels = PixelRange(enc.layout.min_pixels, min(enc.layout.max_pixels, args.max_blocks * block * block))
    images = noise_images(args.images, (1024, 1024), 0)
    patches = enc.layout.num_tokens(enc.layout.grid(1024, 1024, pixels)) * enc.layout.merge_size ** 2
    result: dict = {"patches_per_image": patches}
    result["products"] = product_figures(enc.tower, {"block": patches, "merger": patches // 4}, args.images)
    for label in ("bf16", "fp8"):
        if label == "fp8":
            enc.quantize("fp8")
        batch = profile_batch(enc, images, pixels)
        result[f"profile_{label}"] = batch
        print_table(f"{label} tower, {args.images} images: top device kernels", ["kernel", "calls", "ms"],
                    batch["top"])
        print(f"  {label}: wall {batch['wall_ms']:.1f} ms, device {batch['device_ms']:.1f} ms", flush=True)
    save_result("vision_fp8", args, result)
    return 0


def profile_batch(enc, images, pixels: PixelRange, n: int = 18) -> dict:
    """profile_forward's table for one forward over all `images`."""
    from torch.profiler import ProfilerActivity, profile

    prepared = [enc.prepare(im, pixels) for im in images]
    enc.encode_prepared(prepared)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        enc.encode_prepared(prepared)
        end.record()
        end.synchronize()
    rows, device_us = [], 0.0
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if us > 0 and not ev.key.startswith("aten::"):  # kernels, not the ops that launched them
            device_us += us
            rows.append([ev.key[:70], ev.count, round(us / 1000, 3)])
    rows.sort(key=lambda r: -r[2])
    return {"wall_ms": start.elapsed_time(end), "device_ms": device_us / 1000, "top": rows[:n]}


if __name__ == "__main__":
    raise SystemExit(main())
