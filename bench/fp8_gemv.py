"""The decoder's weight products at small batches: bf16 (cuBLAS) against the FP8 kernels, per matrix.

    python -m bench.fp8_gemv [--shapes all|llava-1.5-7b|...] [--rows 1,2,4,8,16,32,64] [--out gemv.json]

For each matrix of a layer (q/k/v fused, o, gate/up fused, down) of each family and each row count: the
time of one product and the bandwidth it reaches (weight bytes / time; the activations are negligible at
these sizes) for cuBLAS bf16, the one-pass FP8 kernels of before (`weight_only_fp8(split_k=False)`) and
the FP8 path now (`fp8_linear`: split-K at 2..64 rows), and FP8 x FP8 on the tensor cores with the
activations quantized per token (`scaled_mm_fp8`, what rows above MMSERVE_FP8_WEIGHT_ONLY_ROWS take), beside
the copy bandwidth measured in the same run; at one row also the split-K kernel, the Triton GEMV and the
TMA-streamed GEMV (stream_gemv.py, Hopper; FP8 and bf16 weights) forced, with every config's time the
stream GEMV measured (JSON: `stream_choices_us`); where the split-K autotuner ran, the config it chose and
every config's time (JSON: `*_splitk_tuning_us`); then per family the weight products' time per decode
step (one layer's four products x layers). MMSERVE_PDL=0 turns programmatic dependent launch off for the
A/B (pdl.py), MMSERVE_STREAM_GEMV=0 the TMA-streamed GEMV.

Timed as decode runs them: the calls over enough distinct copies of the weight that they do not fit in
L2 (a single weight would be read from L2 after the first call), back to back in one CUDA graph that is
replayed (graph_timing.graph_time_us), so launch overhead is what a captured decode step pays. Autotuning
(every FP8 kernel is tuned per rows bucket and matrix on its first call) happens before the capture.
CUDA only; about 2-3 minutes on an H200 with a cold Triton cache (every family, every row count).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence

import torch

SHAPES = {  # (name, out rows N, in columns K) of one layer; qkv and gate_up are fused as served
    "llava-1.5-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                     ("down", 4096, 11008)],
    "qwen2.5-vl-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584),
                      ("down", 3584, 18944)],
    # hidden 4096, intermediate 12288, 32 heads + 2 x 8 kv heads of 128
    "qwen3-vl-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                    ("down", 4096, 12288)],
}
LAYERS = {"llava-1.5-7b": 32, "qwen2.5-vl-7b": 28, "qwen3-vl-8b": 36}
PATHS = ("bf16", "fp8_old", "fp8_new", "fp8_mm")
MIN_COPIES = 8


def _copies(nbytes: int, l2: int) -> int:
    """How many distinct weights one timing rotates over: at least MIN_COPIES, and at least 3x L2."""
    return max(MIN_COPIES, -(-3 * l2 // nbytes))


def _config_name(config) -> str:
    kw = config.kwargs
    form = f"p{kw['PROGRAMS_PER_SM']}" if kw.get("PROGRAMS_PER_SM") else f"s{kw['SPLIT_K']}"  # stream-K: p
    return (f"n{kw['BLOCK_N']}k{kw['BLOCK_K']}{form}w{config.num_warps}st{config.num_stages}"
            f"{'-swap' if kw.get('SWAP_AB') else ''}")


def time_matrix(n: int, k: int, rows: Sequence[int], l2: int, dev: torch.device) -> list[dict]:
    """Every path at every row count for one [n, k] weight; returns one result row per row count."""
    from common.kernels import stream_gemv
    from common.kernels.fp8_linear import fp8_linear, scaled_mm_fp8, weight_only_fp8
    from common.kernels.fp8_split_k import _split_k
    from common.kernels.graph_timing import graph_time_us
    from decoder_svc.model.quant.fp8 import per_channel_block, quantize_per_channel

    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    q, scale = quantize_per_channel(w)
    block = per_channel_block(k)
    dequantized = (q.float() * scale).to(torch.bfloat16).float()  # what the FP8 paths should compute
    bf16 = [w] + [w.clone() for _ in range(_copies(2 * n * k, l2) - 1)]
    fp8 = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(_copies(n * k, l2) - 1)]
    del w
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        calls = {
            "bf16": [functools.partial(torch.nn.functional.linear, x, wc) for wc in bf16],
            "fp8_old": [functools.partial(weight_only_fp8, x, qc, sc, block, None, split_k=False)
                        for qc, sc in fp8],
            "fp8_new": [functools.partial(fp8_linear, x, qc, sc, block) for qc, sc in fp8],
            "fp8_mm": [functools.partial(scaled_mm_fp8, x, qc, sc, None) for qc, sc in fp8],
        }
        if m == 1:
            calls["fp8_splitk"] = [functools.partial(weight_only_fp8, x, qc, sc, block, None, split_k=True)
                                   for qc, sc in fp8]
            calls["fp8_triton_gemv"] = [
                functools.partial(weight_only_fp8, x, qc, sc, block, None, stream=False) for qc, sc in fp8]
            if stream_gemv.usable(x, q):
                calls["fp8_stream"] = [functools.partial(weight_only_fp8, x, qc, sc, block, None, stream=True)
                                       for qc, sc in fp8]
                calls["bf16_stream"] = [functools.partial(stream_gemv.stream_gemv, x, wc) for wc in bf16]
        ref = torch.nn.functional.linear(x.float(), dequantized)
        row = {"n": n, "k": k, "rows": m, "copies_bf16": len(bf16), "copies_fp8": len(fp8)}
        for path, path_calls in calls.items():
            _split_k.configs_timings = None
            try:
                got = path_calls[0]().float()  # tunes the kernel for this shape, outside any capture
            except RuntimeError as e:  # a shape _scaled_mm does not take: reported, not timed
                print(f"{path} n={n} k={k} rows={m}: {e}".splitlines()[0])
                row.update({f"{path}_rel_err": None, f"{path}_us": None, f"{path}_gbps": None})
                continue
            if _split_k.configs_timings:  # the split-K autotuner ran: what it chose, and every config's time
                row[f"{path}_splitk_chosen"] = _config_name(_split_k.best_config)
                row[f"{path}_splitk_tuning_us"] = {
                    _config_name(c): 1e3 * (ms[0] if isinstance(ms, list) else ms)
                    for c, ms in sorted(_split_k.configs_timings.items(), key=lambda kv: kv[1])}
            row[f"{path}_rel_err"] = ((got - ref).norm() / ref.norm()).item()
            us = graph_time_us(path_calls)
            row[f"{path}_us"] = us
            row[f"{path}_gbps"] = (2 if path.startswith("bf16") else 1) * n * k / us / 1e3
        if m == 1:  # the TMA-streamed GEMV's measured configs (and the Triton GEMV it was timed against)
            row["stream_choices_us"] = {
                str(key.dtype).removeprefix("torch.") + (f" vs {key.rival}" if key.rival else ""):
                choice.times_us for key, choice in stream_gemv.CHOICES.items() if (key.n, key.k) == (n, k)}
        row["new_vs_bf16"] = row["bf16_us"] / row["fp8_new_us"]
        row["new_vs_old"] = row["fp8_old_us"] / row["fp8_new_us"]
        row["mm_vs_new"] = row["fp8_new_us"] / row["fp8_mm_us"] if row["fp8_mm_us"] else None
        out.append(row)
    del bf16, fp8, dequantized
    torch.cuda.empty_cache()
    return out


def run(args: argparse.Namespace) -> dict:
    """Time every (family, matrix, rows) triple; returns the JSON payload."""
    from bench.bandwidth import copy_bandwidth
    from bench.report import print_table, save_result

    dev = torch.device(args.device)
    bandwidth = copy_bandwidth(args.device, 2 << 30)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = [int(r) for r in args.rows.split(",")]
    families = sorted(SHAPES) if args.shapes == "all" else [args.shapes]
    results, per_token = [], []
    started = time.perf_counter()
    for family in families:
        for name, n, k in SHAPES[family]:
            for r in time_matrix(n, k, rows, l2, dev):
                results.append({"family": family, "matrix": name, **r})
        if args.token_rows in rows:
            at = [r for r in results if r["family"] == family and r["rows"] == args.token_rows]
            step = {p: sum(r[f"{p}_us"] or float("nan") for r in at) * LAYERS[family] for p in PATHS}
            per_token.append({"family": family, "rows": args.token_rows, "layers": LAYERS[family],
                              **{f"{p}_step_us": step[p] for p in PATHS},
                              "new_vs_bf16": step["bf16"] / step["fp8_new"],
                              "old_vs_bf16": step["bf16"] / step["fp8_old"],
                              "mm_vs_bf16": step["bf16"] / step["fp8_mm"]})
    elapsed = time.perf_counter() - started
    print_table(f"weight products (us, GB/s of weight bytes), copy bandwidth {bandwidth / 1e9:.0f} GB/s",
                ["family", "matrix", "rows", "bf16 us", "bf16 GB/s", "old us", "old GB/s", "new us",
                 "new GB/s", "mm us", "mm GB/s", "new/bf16", "new/old", "new/mm", "split-K us (1 row)",
                 "split-K config"],
                [[r["family"], r["matrix"], r["rows"], r["bf16_us"], r["bf16_gbps"], r["fp8_old_us"],
                  r["fp8_old_gbps"], r["fp8_new_us"], r["fp8_new_gbps"], r["fp8_mm_us"], r["fp8_mm_gbps"],
                  r["new_vs_bf16"], r["new_vs_old"], r["mm_vs_new"], r.get("fp8_splitk_us"),
                  r.get("fp8_new_splitk_chosen") or r.get("fp8_splitk_splitk_chosen")]
                 for r in results])
    one_row = [r for r in results if r["rows"] == 1]
    print_table("one row: TMA-streamed GEMV (stream_gemv.py), Triton GEMV, cuBLAS (us, GB/s)",
                ["family", "matrix", "fp8 stream", "GB/s", "fp8 triton", "GB/s", "bf16 stream", "GB/s",
                 "bf16 cuBLAS", "GB/s"],
                [[r["family"], r["matrix"], r.get("fp8_stream_us"), r.get("fp8_stream_gbps"),
                  r["fp8_triton_gemv_us"], r["fp8_triton_gemv_gbps"], r.get("bf16_stream_us"),
                  r.get("bf16_stream_gbps"), r["bf16_us"], r["bf16_gbps"]] for r in one_row])
    print_table(f"weight products per decode step at {args.token_rows} rows (all layers, us)",
                ["family", "layers", "bf16", "fp8 old", "fp8 new", "fp8 mm", "new speed-up", "old speed-up",
                 "mm speed-up"],
                [[t["family"], t["layers"], t["bf16_step_us"], t["fp8_old_step_us"], t["fp8_new_step_us"],
                  t["fp8_mm_step_us"], t["new_vs_bf16"], t["old_vs_bf16"], t["mm_vs_bf16"]]
                 for t in per_token])
    print(f"{elapsed:.0f} s (tuning included)")
    return save_result("fp8_gemv", args, results, per_token=per_token, copy_bandwidth_bytes_per_s=bandwidth,
                       l2_bytes=l2, seconds=elapsed)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gemv", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="all", choices=["all", *sorted(SHAPES)])
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--token-rows", type=int, default=32, help="rows of the per-decode-step summary")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
