"""How fast one MoE layer's experts run (common/kernels/fused_moe.py) with each grouped-GEMM tiling, at
decode and prefill token counts, beside cuBLAS's dense products of the same useful FLOPs.

    # one H100 or H200, Qwen3-VL-30B-A3B's expert shapes (the defaults):
    python -m bench.moe_tiling --device cuda --tokens 1,32,128,512,1536,2048 --out moe_tiling.json
    # a CPU smoke run goes through Triton's interpreter under pytest (tests/bench/test_moe_tiling.py)

Per token count: every tiling (`--configs`, default: the decode tilings choose_config measures plus the
prefill candidates below) times the whole fused_moe call (sort, both products, combine) and, for the
tiling default_config picks, each of those parts alone; and the same call through torch's grouped GEMM
(moe_grouped_mm.py, the other path a prefill may take: moe_tuning.py); up to moe_tuning.GEMV_TOKENS
tokens also the per-assignment GEMVs (moe_gemv.py); each with the rate at which it reads the experts the
routing hits. Routing is uniform (each token's top_k drawn at random), as trained routers spread;
`--routings` distinct routings and copies of the experts beyond L2 rotate so the weights stream from
memory as in a model. Time per call: CUDA graphs of
the calls replayed (graph_timing.graph_time_us) up to --graph-tokens tokens, CUDA events around eager
calls beyond (graph_timing.event_time_us; as the decoder runs them: graphs for decode and short
prefills, eager for long ones). The dense reference: torch's products of the same rows without any sort
or padding ([T * top_k, H] @ [H, 2I] and [T * top_k, I] @ [I, H]), what one perfectly balanced expert
would cost. TFLOP/s counts the useful FLOPs only (2 * T * top_k * 3 * H * I).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.report import print_table, save_result

# Prefill candidates beside default_config's (vLLM's and SGLang's tuned tables for H100 experts of this
# size sit among these: 64-128 rows, 64-256 columns, K tiles of 64-128).
PREFILL_CANDIDATES = (
    "64x128x64/8w3s", "64x128x64/4w4s", "64x64x64/4w4s", "64x256x64/8w3s", "64x128x128/8w3s",
    "128x128x64/8w3s", "128x128x64/4w3s", "128x64x64/4w4s", "128x256x64/8w3s", "32x64x64/4w4s",
)


def parse_config(text: str):
    """'BMxBNxBK/Ww/Ss[+swap]' -> GemmConfig (e.g. 64x128x64/8w3s); 'gemvBNxBK/Ww[+combine]' -> GemvConfig
    (the per-assignment GEMVs of moe_gemv.py, e.g. gemv16x256/4w); 'tmaBNstSwW' -> StreamMoeConfig."""
    from common.kernels.fused_moe import GemmConfig
    from common.kernels.moe_gemv import GemvConfig

    try:
        if text.startswith("tma"):
            from common.kernels.moe_stream_gemv import StreamMoeConfig

            block_n, rest = text.removeprefix("tma").split("st")
            stages, warps = rest.removesuffix("w").split("w")
            return StreamMoeConfig(int(block_n), int(stages), int(warps))
        if text.startswith("gemv"):
            tiles, rest = text.removeprefix("gemv").split("/")
            block_n, block_k = (int(v) for v in tiles.split("x"))
            warps, _, fused = rest.partition("+")
            if fused not in ("", "combine"):
                raise ValueError(fused)
            return GemvConfig(block_n, block_k, int(warps.removesuffix("w")), fuse_combine=bool(fused))
        tiles, rest = text.split("/")
        block_m, block_n, block_k = (int(v) for v in tiles.split("x"))
        rest, _, swap = rest.partition("+")
        if swap not in ("", "swap"):
            raise ValueError(swap)
        warps, stages = rest.removesuffix("s").split("w")
        return GemmConfig(block_m, block_n, block_k, int(warps), int(stages), swap_ab=bool(swap))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"tiling {text!r}: expected BMxBNxBK/Ww/Ss[+swap] (e.g. 64x128x64/8w3s), "
            "gemvBNxBK/Ww[+combine] or tmaBNstSwW"
        ) from e


def config_name(config) -> str:
    """The tiling as parse_config reads it."""
    from common.kernels.moe_tuning import config_name as name

    return name(config)


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the tiling benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.moe_tiling", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,32,128,512,1536,2048")
    p.add_argument("--configs", default="", help="comma-separated tilings BMxBNxBK/Ww/Ss (default: the "
                   "decode tilings and the prefill candidates)")
    p.add_argument("--routings", type=int, default=4)
    p.add_argument("--graph-tokens", type=int, default=512,
                   help="time in replayed CUDA graphs up to this many tokens, eager beyond")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    return p


def _timer(device: torch.device, graph: bool, repeats: int) -> Callable[[list[Callable[[], object]]], float]:
    """us per call of a list of calls: graph replays or CUDA events around eager calls, or on a CPU the
    wall clock (the interpreter's smoke run: meaningless as a speed)."""
    if device.type == "cuda":
        from common.kernels.graph_timing import event_time_us, graph_time_us

        return graph_time_us if graph else functools.partial(event_time_us, rounds=repeats)

    def wall_us(calls: list[Callable[[], object]]) -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)

    return wall_us


@dataclass
class Layer:
    """One MoE layer's experts (copies of them, so timings stream weights from memory) and its shapes."""

    weights: list[tuple[torch.Tensor, torch.Tensor]]  # (gate_up [E, 2W, H], down [E, H, W]) per copy
    experts: int
    hidden: int
    width: int
    top_k: int


def time_tokens(layer: Layer, tokens: int, configs: list, args: argparse.Namespace,
                gen: torch.Generator) -> dict:
    """One row of the result: every tiling's time for `tokens` tokens, the default's parts, the dense
    reference."""
    from triton.runtime.errors import OutOfResources

    from common.kernels.fused_moe import GemmConfig, combine, default_config, grouped_gemm
    from common.kernels.moe_align import align_to_blocks, padded_rows
    from common.kernels.moe_stream_gemv import StreamMoeConfig
    from common.kernels.moe_stream_gemv import usable as stream_usable
    from common.kernels.moe_tuning import DECODE_CONFIGS, GEMV_TOKENS, TUNED_TOKENS, run_experts

    device, dtype = layer.weights[0][0].device, layer.weights[0][0].dtype
    hidden, width, top_k, rows = layer.hidden, layer.width, layer.top_k, tokens * layer.top_k
    timer = _timer(device, tokens <= args.graph_tokens, args.repeats)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    ids = [torch.rand(tokens, layer.experts, generator=gen, device=device).topk(top_k, dim=-1).indices
           .to(torch.int32) for _ in range(args.routings)]
    topk_w = torch.full((tokens, top_k), 1.0 / top_k, dtype=dtype, device=device)
    work = [(w, i) for w in layer.weights for i in ids][:max(args.routings, len(layer.weights))]
    flops = 2 * rows * 3 * hidden * width
    # the weight bytes a call must read at least: each expert the routing hits, once (averaged over routings)
    hit = sum(i.unique().numel() for i in ids) / len(ids)
    expert_bytes = hit * 3 * hidden * width * layer.weights[0][0].element_size()
    row = {"tokens": tokens, "useful_gflop": round(flops / 1e9, 3), "experts_hit": hit,
           "expert_mb": round(expert_bytes / 1e6, 1), "tilings": {}}
    for config in configs:
        gemm = isinstance(config, GemmConfig)
        if not gemm and tokens > GEMV_TOKENS:
            continue  # the GEMVs are measured where choose_config measures them
        if isinstance(config, StreamMoeConfig) and not stream_usable(x, *layer.weights[0]):
            continue  # TMA: Hopper only
        calls = [functools.partial(run_experts, x, w[0], w[1], topk_w, i, config) for w, i in work]
        try:
            us = timer(calls)
        except OutOfResources:
            row["tilings"][config_name(config)] = None
            continue
        row["tilings"][config_name(config)] = {
            "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
            "weight_tb_s": round(expert_bytes / us / 1e6, 2),
            "rows_allocated_per_row": round(padded_rows(rows, layer.experts, config.block_m) / rows, 2)
            if gemm else 1.0}
    row["grouped_mm"] = _time_grouped_mm(timer, x, work, topk_w, flops)
    done = {k: v for k, v in row["tilings"].items() if v}
    row["best"] = min(done, key=lambda k: done[k]["us"])
    default = default_config(tokens) if tokens > TUNED_TOKENS else DECODE_CONFIGS[0]
    row["default"] = config_name(default)
    (gate_up, down), i = work[0]
    align = align_to_blocks(i, layer.experts, default.block_m)
    h = grouped_gemm(x, gate_up, align, rows, top_k, True, default)
    out = grouped_gemm(h, down, align, rows, top_k, False, default, topk_w.reshape(-1), swiglu=True)
    parts = {
        "sort": functools.partial(align_to_blocks, i, layer.experts, default.block_m),
        "gate_up": functools.partial(grouped_gemm, x, gate_up, align, rows, top_k, True, default),
        "down": functools.partial(grouped_gemm, h, down, align, rows, top_k, False, default,
                                  topk_w.reshape(-1), swiglu=True),
        "combine": functools.partial(combine, out, tokens, top_k),
    }
    row["default_parts_us"] = {name: round(timer([call]), 2) for name, call in parts.items()}
    a = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    m = torch.randn(rows, width, generator=gen, device=device).to(dtype)
    dense_us = timer([functools.partial(torch.mm, a, gate_up[0].t()),
                      functools.partial(torch.mm, m, down[0].t())])
    dense_us *= 2  # the timer's figure is per call: the two products make one reference
    row["dense_reference"] = {"us": round(dense_us, 2), "tflops": round(flops / dense_us / 1e6, 1)}
    return row


def _time_grouped_mm(timer, x: torch.Tensor, work: list, topk_w: torch.Tensor, flops: int) -> dict | None:
    """torch's grouped GEMM path (moe_grouped_mm.py, a prefill's other path) over the same work,
    combine included; None where it does not apply, the error where it fails."""
    from common.kernels.fused_moe import combine
    from common.kernels.moe_grouped_mm import grouped_mm_rows, supported

    if not supported(x, work[0][0][0]):
        return None

    def call(w, ids):
        return combine(grouped_mm_rows(x, w[0], w[1], topk_w, ids), *ids.shape)

    try:
        us = timer([functools.partial(call, w, i) for w, i in work])
    except RuntimeError as e:
        return {"error": str(e)[:300]}
    return {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1)}


def run(args: argparse.Namespace) -> dict:
    """Time; returns the JSON payload."""
    from common.kernels.moe_tuning import DECODE_CONFIGS, GEMV_CONFIGS, STREAM_CONFIGS

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    experts, hidden, width = args.experts, args.hidden, args.width
    configs = ([parse_config(c) for c in args.configs.split(",") if c] if args.configs else
               list(dict.fromkeys([*DECODE_CONFIGS, *GEMV_CONFIGS, *STREAM_CONFIGS,
                                   *(parse_config(c) for c in PREFILL_CANDIDATES)])))
    gen = torch.Generator(device=device).manual_seed(0)
    copies = 1
    if device.type == "cuda":
        from common.kernels.graph_timing import copy_count

        copies = copy_count(3 * experts * hidden * width * torch.finfo(dtype).bits // 8, device)
    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).to(dtype)

    weights = [(draw(experts, 2 * width, hidden), draw(experts, hidden, width)) for _ in range(copies)]
    layer = Layer(weights, experts, hidden, width, args.top_k)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = time_tokens(layer, tokens, configs, args, gen)
        rows.append(row)
        best, default = row["tilings"][row["best"]], row["tilings"].get(row["default"]) or {}
        grouped = row["grouped_mm"] or {}
        grouped_us = grouped.get("us", grouped.get("error"))
        print(f"{tokens} tokens: best {row['best']} {best['us']} us ({best['tflops']} TFLOP/s), default "
              f"{row['default']} {default.get('us')} us, grouped_mm {grouped_us} us, dense "
              f"{row['dense_reference']['us']} us", flush=True)
    table = [[r["tokens"], r["best"], r["tilings"][r["best"]]["us"], r["tilings"][r["best"]]["tflops"],
              r["default"], (r["tilings"].get(r["default"]) or {}).get("us", "-"),
              (r["grouped_mm"] or {}).get("us", "-"), r["dense_reference"]["us"],
              r["dense_reference"]["tflops"]] for r in rows]
    print_table("MoE layer experts by tiling", ["tokens", "best", "us", "TFLOP/s", "default", "default us",
                                                 "grouped_mm us", "dense us", "dense TFLOP/s"], table)
    return save_result("moe_tiling", args, rows, pdl=os.environ.get("MMSERVE_PDL", "1"))


def main(argv: list[str] | None = None) -> None:
    run(build_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
