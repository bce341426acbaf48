"""The deterministic mode's product (common/kernels/invariant_matmul.py) against torch's (cuBLAS), by rows.

    python -m bench.invariant_matmul [--shapes qwen3-vl-8b] [--rows 1,8,32,512,4096] [--sweep] [--out f.json]

For each weight shape (default Qwen3-VL-8B's layer: o 4096x4096, qkv 6144x4096, gate_up 24576x4096, down
4096x12288, as N x K) and row count M, in bf16: the time of invariant_matmul(x, w.t()) with its own
configuration (`invariant_tiles`) and, with --sweep, with each of SWEEP's tile shapes (the split of K by
the same rule), beside F.linear(x, w) (what the normal mode runs); GB/s (weight + activation + output
bytes / time) and TFLOP/s of each; whether the rows of every M are the bits of the same rows in the
largest M's product (`rows_invariant`); then per M the layer's sum (the four products), whose ratio
torch / invariant bounds what the mode costs a step's products.
Timings are graph_timing.graph_time_us's: calls over enough copies of the weight that none stays in L2,
back to back in one CUDA graph, as a decode step replays them. `--device cpu` (Triton's interpreter, tiny
`--shapes NxK,...` only) times one call by the wall clock: a smoke run of the code, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.report import print_table, save_result

# Qwen3-VL-8B's text layer (hidden 4096, 32 heads + 2 x 8 KV heads of 128, intermediate 12288): N x K.
SHAPES = {"qwen3-vl-8b": [("o", 4096, 4096), ("qkv", 6144, 4096), ("gate_up", 24576, 4096),
                          ("down", 4096, 12288)]}
# --sweep's tile shapes (block_m, block_n, block_k, num_warps, num_stages); 64-row tiles take Hopper's
# warpgroup products, 16- and 32-row ones the older MMA.
SWEEP = [(16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4),
         (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3)]


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """A preset's name (SHAPES) or comma-separated NxK."""
    if spec in SHAPES:
        return SHAPES[spec]
    shapes = []
    for item in spec.split(","):
        n, k = (int(v) for v in item.lower().split("x"))
        shapes.append((item, n, k))
    return shapes


def configurations(n: int, k: int, sweep: bool, sms: int) -> list[tuple[str, object]]:
    """(label, tiles) to time: the product's own configuration, then SWEEP's (split by the same rule)."""
    from common.kernels.invariant_matmul import InvariantTiles, invariant_tiles, split_of_k

    own = invariant_tiles(n, k, torch.bfloat16, sms)
    configs = [("default", own)]
    for bm, bn, bk, warps, stages in SWEEP if sweep else ():
        split, span = split_of_k(n, k, bn, bk, sms)
        tiles = InvariantTiles(bm, bn, bk, split, span, warps, stages)
        if tiles != own:
            configs.append((f"{bm}x{bn}x{bk} w{warps} s{stages}", tiles))
    return configs


def _wall_us(calls: list[Callable[[], object]]) -> float:
    """The CPU's stand-in for graph_time_us: one call's wall time (after one untimed)."""
    calls[0]()
    start = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - start) * 1e6


def _timer(device: str) -> Callable[[list[Callable[[], object]]], float]:
    if device == "cpu":
        return _wall_us
    from common.kernels.graph_timing import graph_time_us

    return graph_time_us


def _weights(n: int, k: int, device: str) -> list[torch.Tensor]:
    """The weight and its copies, enough that none is read from L2 (one on the CPU)."""
    copies = 1
    if device != "cpu":
        from common.kernels.graph_timing import copy_count

        copies = copy_count(n * k * 2, torch.device(device))
    return [(torch.randn(n, k, device=device) / k ** 0.5).bfloat16() for _ in range(copies)]


def measure_shape(name: str, n: int, k: int, rows: list[int], args: argparse.Namespace) -> list[dict]:
    """Every (configuration, M) of one weight shape: a row per timing."""
    from common.kernels.invariant_matmul import device_sms, invariant_matmul

    device = args.device
    timer = _timer(device)
    weights = _weights(n, k, device)
    x_all = torch.randn(max(rows), k, device=device).bfloat16()
    sms = device_sms(torch.device(device))
    out = []
    torch_us = {m: timer([functools.partial(F.linear, x_all[:m], w) for w in weights]) for m in rows}
    for label, tiles in configurations(n, k, args.sweep, sms):
        full = invariant_matmul(x_all, weights[0].t(), tiles=tiles)
        for m in rows:
            x = x_all[:m]
            us = timer([functools.partial(invariant_matmul, x, w.t(), tiles=tiles) for w in weights])
            nbytes = 2 * (n * k + m * k + m * n)
            flops = 2 * m * n * k
            out.append({"matrix": name, "n": n, "k": k, "m": m, "config": label, **dataclasses.asdict(tiles),
                        "invariant_us": us, "torch_us": torch_us[m],
                        "invariant_gbps": nbytes / us / 1e3, "torch_gbps": nbytes / torch_us[m] / 1e3,
                        "invariant_tflops": flops / us / 1e6, "torch_tflops": flops / torch_us[m] / 1e6,
                        "torch_over_invariant": torch_us[m] / us,
                        "rows_invariant": torch.equal(invariant_matmul(x, weights[0].t(), tiles=tiles),
                                                      full[:m])})
    del weights
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def layer_sums(results: list[dict]) -> list[dict]:
    """Per (configuration, M): the shapes' summed times (a layer's products, for the default shapes)."""
    sums: dict[tuple[str, int], dict] = {}
    for r in results:
        s = sums.setdefault((r["config"], r["m"]), {"config": r["config"], "m": r["m"], "invariant_us": 0.0,
                                                     "torch_us": 0.0, "rows_invariant": True})
        s["invariant_us"] += r["invariant_us"]
        s["torch_us"] += r["torch_us"]
        s["rows_invariant"] &= r["rows_invariant"]
    for s in sums.values():
        s["torch_over_invariant"] = s["torch_us"] / s["invariant_us"]
    return list(sums.values())


def run(args: argparse.Namespace) -> dict:
    """Time every (shape, configuration, M); returns the JSON payload."""
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    for name, n, k in parse_shapes(args.shapes):
        results.extend(measure_shape(name, n, k, rows, args))
    print("\ninvariant product vs torch (bf16): us, GB/s, TFLOP/s each; torch/inv > 1: invariant faster")
    for r in results:
        print(f"{r['matrix']:>8} {r['n']}x{r['k']} M={r['m']:<5} {r['config']:<18} split {r['split_k']:<2} "
              f"inv {r['invariant_us']:9.1f} {r['invariant_gbps']:7.0f} {r['invariant_tflops']:6.1f}  "
              f"torch {r['torch_us']:9.1f} {r['torch_gbps']:7.0f} {r['torch_tflops']:6.1f}  "
              f"torch/inv {r['torch_over_invariant']:5.2f}  rows same {r['rows_invariant']}")
    sums = layer_sums(results)
    print_table("the shapes summed (a layer's products)",
                ["config", "M", "invariant us", "torch us", "torch/inv", "rows same"],
                [[s["config"], s["m"], s["invariant_us"], s["torch_us"], s["torch_over_invariant"],
                  s["rows_invariant"]] for s in sums])
    return save_result("invariant_matmul", args, results, sums=sums)


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse argv and run; returns the payload."""
    p = argparse.ArgumentParser(prog="python -m bench.invariant_matmul", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen3-vl-8b", help="a preset (qwen3-vl-8b) or NxK,NxK,...")
    p.add_argument("--rows", default="1,8,32,512,4096")
    p.add_argument("--sweep", action="store_true", help="also time SWEEP's tile shapes")
    p.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    p.add_argument("--out", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
