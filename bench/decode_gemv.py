"""Batch-1 decode's weight products, kernel by kernel: the separate op + product against the fused one-row
kernel (common/kernels/decode_gemv.py), in bf16 and FP8, at each family's real shapes.

    python -m bench.decode_gemv [--families llava-1.5-7b,qwen2.5-vl-7b,qwen3-vl-8b] [--out gemv.json]

For every projection of a layer (q/k/v after the RMS norm, o, gate/up after the RMS norm, down after
SiLU x up) and the output head (after the final norm): the time of the separate path (Triton op, then
cuBLAS for bf16 or the FP8 kernels of common/kernels/fp8_linear.py), of the fused kernel (autotuned),
and the bandwidth each reaches (weight bytes / time); then per family the sum over one token (every
layer and the head) beside the time the copy bandwidth measured in the same run would need for those
bytes.
Timings are graph_timing.graph_time_us's, as the decoder's start-up choice makes them: calls over enough
copies of the weight that none stays in L2, back to back in one CUDA graph, as a decode step replays
them. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bench.bandwidth import copy_bandwidth
from bench.report import print_table, save_result


@dataclass(frozen=True)
class TextShapes:
    """A family's language model as far as batch-1 decode's products go."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    qkv_bias: bool

    def products(self) -> list[tuple[str, int, int, str, int]]:
        """(name, N, K, op before it, times per token)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [("qkv", qkv, self.hidden, "norm", self.layers),
                ("o", self.hidden, self.heads * self.head_dim, "plain", self.layers),
                ("gate_up", 2 * self.intermediate, self.hidden, "norm", self.layers),
                ("down", self.hidden, self.intermediate, "silu", self.layers),
                ("head", self.vocab, self.hidden, "norm", 1)]


# The real checkpoints' text configs (the presets of the same names copy them).
FAMILIES = {
    "llava-1.5-7b": TextShapes(4096, 11008, 32, 32, 128, 32064, 32, False),
    "qwen2.5-vl-7b": TextShapes(3584, 18944, 28, 4, 128, 152064, 28, True),
    "qwen3-vl-8b": TextShapes(4096, 12288, 32, 8, 128, 151936, 36, False),
}


def _projection(n: int, k: int, bias: bool, fp8: bool) -> nn.Module:
    from decoder_svc.model.kernel_dispatch import TritonOps
    from decoder_svc.model.quant.fp8 import per_channel_block, quantize_per_channel
    from decoder_svc.model.quant.linear import Fp8Linear

    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, k**-0.5)
    if not fp8:
        return lin
    q, scale = quantize_per_channel(lin.weight.detach())
    out = Fp8Linear(k, n, per_channel_block(k), TritonOps, bias, torch.bfloat16, "cuda")
    with torch.no_grad():
        out.weight.copy_(q)
        out.weight_scale.copy_(scale)
        if bias:
            out.bias.copy_(lin.bias)
    return out


def measure(n: int, k: int, op: str, bias: bool, fp8: bool) -> tuple[float, float]:
    """(separate us, fused us) for one projection, timed as the decoder's start-up choice times them."""
    from common.kernels import decode_gemv as g
    from common.kernels.graph_timing import graph_time_us
    from decoder_svc.model import kernel_dispatch as d
    from decoder_svc.model.kernel_dispatch import TritonOps

    projs = d.copies(_projection(n, k, bias, fp8))
    width = 2 * k if op == "silu" else k
    x = torch.randn(1, width, device="cuda").to(torch.bfloat16)
    residual = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    if op == "norm":
        def separate(p):
            return p(TritonOps.rms_norm(x, norm_w, 1e-6, residual)[0])
        fused = [functools.partial(g.fused_gemv, x, d.gemv_weight(p), g.RMS_NORM, residual, norm_w, 1e-6)
                 for p in projs]
    elif op == "silu":
        def separate(p):
            return p(TritonOps.silu_and_mul(x))
        fused = [functools.partial(g.fused_gemv, x, d.gemv_weight(p), g.SILU_MUL) for p in projs]
    else:
        def separate(p):
            return p(x)
        fused = [functools.partial(g.fused_gemv, x, d.gemv_weight(p)) for p in projs]
    return (graph_time_us([functools.partial(separate, p) for p in projs]), graph_time_us(fused))


def run(args: argparse.Namespace) -> dict:
    """Time every (family, projection, dtype); returns the JSON payload."""
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows, totals = [], []
    for family in args.families.split(","):
        shapes = FAMILIES[family]
        for dtype in args.dtypes.split(","):
            fp8 = dtype == "fp8"
            sums = {"separate_us": 0.0, "fused_us": 0.0, "best_us": 0.0, "bytes": 0}
            for name, n, k, op, times in shapes.products():
                bias = shapes.qkv_bias and name == "qkv"
                quantized = fp8 and name != "head"  # the head stays bf16 under --quantization fp8
                t_sep, t_fused = measure(n, k, op, bias, quantized)
                torch.cuda.empty_cache()  # the head's weight is a gigabyte
                nbytes = n * k * (1 if quantized else 2)
                rows.append({"family": family, "dtype": dtype, "matrix": name, "n": n, "k": k, "op": op,
                             "separate_us": t_sep, "fused_us": t_fused,
                             "separate_gbps": nbytes / t_sep / 1e3, "fused_gbps": nbytes / t_fused / 1e3,
                             "speedup": t_sep / t_fused})
                sums["separate_us"] += times * t_sep
                sums["fused_us"] += times * t_fused
                sums["best_us"] += times * min(t_sep, t_fused)
                sums["bytes"] += times * nbytes
            sums["bound_us"] = sums["bytes"] / bandwidth * 1e6
            totals.append({"family": family, "dtype": dtype, **sums})
    print_table(f"one-row products (copy bandwidth {bandwidth / 1e9:.0f} GB/s)",
                ["family", "dtype", "matrix", "N x K", "op", "separate us", "GB/s", "fused us", "GB/s",
                 "speed-up"],
                [[r["family"], r["dtype"], r["matrix"], f"{r['n']}x{r['k']}", r["op"], r["separate_us"],
                  r["separate_gbps"], r["fused_us"], r["fused_gbps"], r["speedup"]] for r in rows])
    print_table("per token (every layer and the head)",
                ["family", "dtype", "separate ms", "fused ms", "best of each ms", "copy-bandwidth ms"],
                [[t["family"], t["dtype"], t["separate_us"] / 1e3, t["fused_us"] / 1e3, t["best_us"] / 1e3,
                  t["bound_us"] / 1e3] for t in totals])
    return save_result("decode_gemv", args, rows, per_token=totals, copy_bandwidth_bytes_per_s=bandwidth)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    p = argparse.ArgumentParser(prog="python -m bench.decode_gemv", description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
