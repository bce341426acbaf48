"""The decoder's weight products at small batches: bf16 (cuBLAS) against the FP8 kernels, per matrix.

    python -m bench.fp8_gemv [--shapes llava-1.5-7b] [--rows 1,8,32] [--out gemv.json]

For each matrix of a 7B layer (q/k/v fused, o, gate/up fused, down) and each row count, the time of one
product and the bandwidth it reaches (weight bytes / time; the activations are negligible at these
sizes), beside the copy bandwidth measured in the same run. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch
import triton.testing

from bench.bandwidth import copy_bandwidth
from bench.report import print_table, save_result
from decoder_svc.model.quant.fp8 import per_channel_block, quantize_per_channel
from decoder_svc.model.quant.triton_fp8 import fp8_linear

SHAPES = {  # (name, out rows N, in columns K)
    "llava-1.5-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                     ("down", 4096, 11008)],
    "qwen2.5-vl-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584),
                      ("down", 3584, 18944)],
}


def run(args: argparse.Namespace) -> dict:
    """Time every (matrix, rows) pair; returns the JSON payload."""
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = []
    for name, n, k in SHAPES[args.shapes]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        q, scale = quantize_per_channel(w)
        block = per_channel_block(k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            fp8_linear(x, q, scale, block)  # tunes its kernel for this shape
            t_bf16 = triton.testing.do_bench(functools.partial(torch.nn.functional.linear, x, w),
                                             warmup=25, rep=200)
            t_fp8 = triton.testing.do_bench(functools.partial(fp8_linear, x, q, scale, block),
                                            warmup=25, rep=200)
            rows.append({"matrix": name, "n": n, "k": k, "rows": m, "bf16_us": t_bf16 * 1e3,
                         "fp8_us": t_fp8 * 1e3, "bf16_gbps": 2 * n * k / t_bf16 / 1e6,
                         "fp8_gbps": n * k / t_fp8 / 1e6, "fp8_speedup": t_bf16 / t_fp8})
    print_table(f"weight products, copy bandwidth {bandwidth / 1e9:.0f} GB/s",
                ["matrix", "rows", "bf16 us", "bf16 GB/s", "fp8 us", "fp8 GB/s", "fp8 speed-up"],
                [[r["matrix"], r["rows"], r["bf16_us"], r["bf16_gbps"], r["fp8_us"], r["fp8_gbps"],
                  r["fp8_speedup"]] for r in rows])
    return save_result("fp8_gemv", args, rows, copy_bandwidth_bytes_per_s=bandwidth)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gemv", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llava-1.5-7b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,8,32")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
