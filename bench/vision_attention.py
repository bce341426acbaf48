"""Vision attention at head dims 72 and 80: the Triton varlen kernel (common/kernels/vision_attention.py)
beside torch's SDPA kernels, alone and inside the Qwen towers (and HF's towers) at their real shapes.

    python -m bench.vision_attention --out vision_attention.json [--batches 1,8]
        [--no-sweep | --sweep-budget-s 90] [--towers qwen3-vl-8b,qwen2.5-vl-7b | none] [--no-hf] [--rounds 5]

Kernel cases (16 heads, bf16; q, k, v contiguous as the fused rotary gives them): a 4096-patch image at
head dims 72 and 80, then the real per-image layouts at batch 1 and 8: Qwen3-VL (1024-token images = 64x64
= 4096 patches, head dim 72), Qwen2.5-VL full attention (1225 tokens = 70x70 = 4900 patches, head dim 80)
and its windows (HF's window layout of that grid: 112-px windows, at most 64 patches). Each is run by
`triton` (the kernel's fixed tile table, the project's launch), every SDPA backend that takes the layout
(`cudnn`, `flash`, `efficient` on uniform spans as one dense batch; `fa2_varlen`, the op behind today's
default; `sdpa_grouped`, one call per span length, on uneven spans) and, with the sweep, every candidate
tile of the Triton kernel (`sweep`, best first). Figures: milliseconds (triton.testing.do_bench, median),
TFLOP/s as 4 x sum(length^2) x head_dim x heads per case (non-causal; the real head dim, not the padded
one) and its share of 989 TFLOP/s (dense bf16, H100 and H200 alike), and each output's relative error
against an fp32 reference.

Tower cases: the Qwen3-VL-8B and Qwen2.5-VL-7B towers (random weights, their real shapes, the GPU's fused
elementwise steps) on 1024x1024-sized images (64x64 and 70x70 patches) at each batch, eager and replayed
from CUDA graphs (one SignatureGraphs per kernel: both batch sizes share its pool), with
MMSERVE_VISION_ATTENTION=sdpa and =triton, beside HF's tower on the same weights (bench/vision_path.py's).
Each kernel's graph replays are checked against its eager forward (finite, equal) and the triton tower
against the sdpa tower.

On a CPU (tests) `measure_case` runs the Triton candidates in Triton's interpreter against the reference
instead of timing them, and `tower_figures` times whatever runs there.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

PEAK_TFLOPS = 989.0  # dense bf16 tensor throughput, H100 SXM and H200
HEADS = 16


@dataclass(frozen=True)
class Case:
    """One attention call: spans `bounds` (cu_seqlens) of `heads` heads of `head_dim`."""

    name: str
    head_dim: int
    bounds: tuple[int, ...]
    heads: int = HEADS

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.bounds, dtype=np.int64))

    @property
    def max_seqlen(self) -> int:
        return int(self.lengths.max())

    @property
    def uniform(self) -> bool:
        return bool((self.lengths == self.max_seqlen).all())

    @property
    def flops(self) -> int:
        """4 x sum(length^2) x head_dim x heads: QKᵀ and PV, non-causal."""
        return int(4 * (self.lengths**2).sum() * self.head_dim * self.heads)


def window_lengths(side: int, patch: int = 14, merge: int = 2, window: int = 112) -> np.ndarray:
    """Qwen2.5-VL's window lengths (patches) of one side x side-patch image, HF's layout."""
    from common.families.qwen2_5_vl.tower import grid_windows

    return np.asarray(grid_windows(merge, window // merge // patch, 1, side, side)[1], dtype=np.int64)


def packed(lengths: Sequence[int], batch: int) -> tuple[int, ...]:
    """cu_seqlens of `batch` images of span lengths `lengths` each."""
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(np.tile(lengths, batch))]))


def default_cases(batches: Sequence[int]) -> list[Case]:
    """The 4096-patch image at head dims 72 and 80, then the real per-image layouts at each batch (the
    largest first: the sweep's compiles are done by the first two, and a late case may go unswept)."""
    out = [Case("image4096_hd72", 72, (0, 4096)), Case("image4096_hd80", 80, (0, 4096))]
    windows = window_lengths(70)
    for b in sorted(batches, reverse=True):
        out += [Case(f"qwen3vl_b{b}", 72, packed([4096], b)),
                Case(f"qwen25vl_window_b{b}", 80, packed(windows, b)),
                Case(f"qwen25vl_full_b{b}", 80, packed([4900], b))]
    return out


def candidate_tiles(block_ms: Sequence[int] = (64, 128), block_ns: Sequence[int] = (64, 128),
                    warps: Sequence[int] = (4, 8), stages: Sequence[int] = (2, 3)) -> list:
    """The Triton kernel's tiles swept beside its fixed table."""
    from common.kernels.vision_attention import Tiles

    return [Tiles(m, n, w, s) for m, n, w, s in itertools.product(block_ms, block_ns, warps, stages)]


def _dense(q, k, v, spans: int, scale: float, backend) -> torch.Tensor:
    """One SDPA backend over `spans` equal consecutive spans as a dense batch, [N, heads, D] in and out."""
    from torch.nn.attention import sdpa_kernel

    n, heads, dim = q.shape
    q4, k4, v4 = (t.view(spans, n // spans, heads, dim).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)
    return out.transpose(1, 2).reshape(n, heads, dim)


def _triton_run(q, k, v, case: Case, scale: float, tiles=None) -> Callable[[], torch.Tensor]:
    from common.kernels import vision_attention as va

    tiles = tiles or va.tiles_for(case.head_dim, va.block_m_for(case.max_seqlen))
    cu = torch.tensor(case.bounds, dtype=torch.int32, device=q.device)
    block_map = torch.from_numpy(va.make_block_map(case.bounds, tiles.block_m)).to(q.device)
    return lambda: va.varlen_attention(q, k, v, cu, case.max_seqlen, scale, block_map=block_map, tiles=tiles)


def backends(q, k, v, case: Case, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """Every way to run the case here: the Triton kernel's launch, and on CUDA torch's kernels."""
    from common.vision import attention

    runs = {"triton": _triton_run(q, k, v, case, scale)}
    if q.device.type != "cuda":
        return runs
    from torch.nn.attention import SDPBackend

    cu = torch.tensor(case.bounds, dtype=torch.int32, device=q.device)
    runs["fa2_varlen"] = lambda: attention._varlen(q, k, v, cu, case.max_seqlen, scale)
    spans = len(case.bounds) - 1
    if case.uniform:
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            runs[name] = lambda backend=backend: _dense(q, k, v, spans, scale, backend)
    else:
        grouped = attention.AttentionSpans.from_bounds(case.bounds, q.device, use_flash=False)
        runs["sdpa_grouped"] = lambda: grouped.attend(q, k, v, scale)
    return runs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _time_ms(fn: Callable[[], torch.Tensor]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=20, rep=80, return_mode="median"))


def _figures(case: Case, ms: float | None) -> dict:
    if ms is None:
        return {}
    tflops = case.flops / ms / 1e9
    return {"ms": ms, "tflops": tflops, "pct_peak": 100 * tflops / PEAK_TFLOPS}


def measure_case(case: Case, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 tiles: Sequence | None = None) -> dict:
    """Every backend of the case (and each candidate tile of the Triton kernel): relative error against
    an fp32 reference and, on CUDA, time and TFLOP/s. A backend that fails records its error."""
    from common.vision.attention import AttentionSpans

    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(case.bounds[-1], case.heads, case.head_dim, generator=g, device=device)
               for _ in range(3))
    scale = case.head_dim**-0.5
    ref = AttentionSpans.from_bounds(case.bounds, device, use_flash=False).attend(q, k, v, scale)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    timing = device.type == "cuda"
    row: dict = {"case": case.name, "head_dim": case.head_dim, "heads": case.heads,
                 "spans": len(case.bounds) - 1, "tokens": case.bounds[-1], "max_seqlen": case.max_seqlen,
                 "uniform": case.uniform, "gflop": case.flops / 1e9, "backends": {}}
    for name, run in backends(q, k, v, case, scale).items():
        try:
            err = _rel(run(), ref)
            row["backends"][name] = {"err": err, **_figures(case, _time_ms(run) if timing else None)}
        except Exception as exc:  # noqa: BLE001 - a backend this build or GPU lacks for the shape
            row["backends"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    sweep = []
    for t in tiles or ():
        entry = {"block_m": t.block_m, "block_n": t.block_n, "num_warps": t.num_warps,
                 "num_stages": t.num_stages}
        try:
            run = _triton_run(q, k, v, case, scale, t)
            entry["err"] = _rel(run(), ref)
            entry.update(_figures(case, _time_ms(run) if timing else None))
        except Exception as exc:  # noqa: BLE001 - out of shared memory, or a compile failure
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        sweep.append(entry)
    if sweep:
        row["sweep"] = sorted(sweep, key=lambda e: e.get("ms", float("inf")))
    torch_ms = [b["ms"] for n, b in row["backends"].items() if n != "triton" and "ms" in b]
    if torch_ms and "ms" in row["backends"]["triton"]:
        row["best_torch_ms"] = min(torch_ms)
        row["triton_speedup"] = min(torch_ms) / row["backends"]["triton"]["ms"]
    return row


# -- the towers --------------------------------------------------------------------------------------------

def random_tower(preset: str, device: torch.device, dtype: torch.dtype, **overrides) -> tuple:
    """(tower, vision config dict) of a Qwen preset's real shapes (overrides replace fields), random weights,
    as the encoder runs it on `device`: the fused elementwise steps and Qwen2.5-VL's fused gate/up on CUDA."""
    from common.families.qwen2_5_vl.maker import QWEN_PRESETS
    from common.families.qwen2_5_vl.tower import QwenVisionTower, VisionOps
    from common.families.qwen3_vl.maker import QWEN3_PRESETS
    from common.families.qwen3_vl.tower import Qwen3VisionOps, Qwen3VisionTower

    qwen3 = preset in QWEN3_PRESETS
    spec = QWEN3_PRESETS[preset] if qwen3 else QWEN_PRESETS[preset]
    vision = {**spec.vision, "out_hidden_size": spec.text["hidden_size"], **overrides}
    cls, ops = (Qwen3VisionTower, Qwen3VisionOps) if qwen3 else (QwenVisionTower, VisionOps)
    torch.manual_seed(0)
    with torch.device(device):
        tower = cls(vision)
    tower = tower.to(device, dtype).eval()
    tower.inv_freq = cls.rotary_inv_freq(vision).to(device)  # fp32 whatever the weights' dtype, as loaded
    if device.type == "cuda":
        if not qwen3:
            for block in tower.blocks:
                block.mlp.fuse()
        tower.use_ops(ops.fused())
    return tower, vision


def _timed_s(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    """Median seconds of fn() over `rounds` runs after two warm-ups (synchronised)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _flat(out) -> torch.Tensor:
    """A tower's output as one tensor (Qwen3-VL: the merged features and every DeepStack level)."""
    return out if isinstance(out, torch.Tensor) else torch.cat([out.merged, *out.deepstack])


def tower_figures(preset: str, device: torch.device, dtype: torch.dtype, batches: Sequence[int], rounds: int,
                  hf: bool, side: int | None = None, kernels: Sequence[str] = ("sdpa", "triton"),
                  **overrides) -> dict:
    """images/s of the preset's tower at each batch of side x side-patch images (default: a 1024x1024
    image's, 64 or 70 patches a side) per attention kernel, eager and graph-replayed; the kernels' outputs
    compared; HF's tower on the same weights beside them."""
    from common.vision.attention import ATTENTION_ENV

    tower, vision = random_tower(preset, device, dtype, **overrides)
    side = side or (64 if tower.patch == 16 else 70)
    g = torch.Generator(device).manual_seed(1)
    pixels = torch.randn(max(batches) * side * side, tower.patch_dim, generator=g, device=device).to(dtype)
    out: dict = {"preset": preset, "grid": [1, side, side], "head_dim": tower.dim // tower.num_heads,
                 "depth": len(tower.blocks)}
    outputs = {}
    before = os.environ.get(ATTENTION_ENV)
    try:
        for kernel in kernels:
            os.environ[ATTENTION_ENV] = kernel
            figures, eager = _kernel_figures(tower, pixels, side, batches, device, rounds)
            out.update({f"{kernel}_{key}": value for key, value in figures.items()})
            outputs.update({(kernel, b): value for b, value in eager.items()})
            for b in batches:
                line = f"  {preset} tower {kernel} batch {b}: {figures[f'b{b}_images_per_s']:.1f} images/s"
                if f"graphs_b{b}_images_per_s" in figures:
                    line += f", graphs {figures[f'graphs_b{b}_images_per_s']:.1f}"
                print(line, flush=True)
    finally:
        if before is None:
            os.environ.pop(ATTENTION_ENV, None)
        else:
            os.environ[ATTENTION_ENV] = before
    for (kernel, b), value in outputs.items():
        if kernel != kernels[0]:
            out[f"{kernel}_b{b}_err_vs_{kernels[0]}"] = _rel(value, outputs[(kernels[0], b)])
    if hf:
        out["hf"] = hf_tower_figures(tower, vision, pixels, side, device, dtype, batches, rounds)
        graphs = "graphs_" if device.type == "cuda" else ""
        for b in batches:
            for kernel in kernels:
                ours = out[f"{kernel}_{graphs}b{b}_images_per_s"]
                out[f"{kernel}_{graphs}over_hf_b{b}"] = ours / out["hf"][f"b{b}_images_per_s"]
    return out


def _kernel_figures(tower: torch.nn.Module, pixels: torch.Tensor, side: int, batches: Sequence[int],
                    device: torch.device, rounds: int) -> tuple[dict, dict]:
    """({figure: value}, {batch: eager output}) of the tower with the attention kernel set now: eager
    and (CUDA) graph-replayed timings per batch, every batch captured into one graph pool, then each
    replayed again in turn and compared with its eager output."""
    from common.vision.tower_graphs import SignatureGraphs

    out, eager = {}, {}
    graphs = SignatureGraphs(tower, capture_after=1, max_patches=1 << 30) if device.type == "cuda" else None
    runs = {"": tower} if graphs is None else {"": tower, "graphs_": graphs}
    with torch.inference_mode():
        for b in batches:
            px, grids = pixels[:b * side * side], [(1, side, side)] * b
            eager[b] = _flat(tower(px, grids)).clone()
            for name, fn in runs.items():
                secs = _timed_s(lambda fn=fn, px=px, grids=grids: fn(px, grids), device, rounds)
                out[f"{name}b{b}_ms"] = 1000 * secs
                out[f"{name}b{b}_images_per_s"] = b / secs
        if graphs is not None:
            for b in batches:
                replayed = _flat(graphs(pixels[:b * side * side], [(1, side, side)] * b))
                out[f"graphs_b{b}_finite"] = bool(torch.isfinite(replayed).all())
                out[f"graphs_b{b}_err_vs_eager"] = _rel(replayed, eager[b])
            out["graphs_captured"] = len(graphs)
    return out, eager


def hf_tower_figures(tower: torch.nn.Module, vision: dict, pixels: torch.Tensor, side: int,
                     device: torch.device, dtype: torch.dtype, batches: Sequence[int], rounds: int) -> dict:
    """images/s of HF's tower (bench/vision_path.py's, sdpa attention) with our tower's weights."""
    from bench.vision_path import hf_tower_from_state

    if "deepstack_visual_indexes" in vision:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
    with torch.device(device):  # HF's random init where it runs (the weights are replaced at once)
        model = hf_tower_from_state(Config(**vision), tower.state_dict(), device, dtype)
    out = {}
    for b in batches:
        px = pixels[:b * side * side]
        grid = torch.tensor([[1, side, side]] * b, device=device)
        with torch.inference_mode():
            secs = _timed_s(lambda px=px, grid=grid: model(px, grid_thw=grid), device, rounds)
        out[f"b{b}_ms"] = 1000 * secs
        out[f"b{b}_images_per_s"] = b / secs
        print(f"  HF tower batch {b}: {b / secs:.1f} images/s ({1000 * secs:.1f} ms)", flush=True)
    return out


# -- the run -----------------------------------------------------------------------------------------------

def headline(kernels: list[dict], towers: list[dict]) -> list[list]:
    """[figure, value] rows for bench.merge's table."""
    rows = []
    for r in kernels:
        t = r["backends"].get("triton", {})
        if "tflops" in t:
            rows.append([f"vision attention {r['case']}: Triton TFLOP/s (% of peak)",
                         f"{t['tflops']:.0f} ({t['pct_peak']:.0f}%)"])
        if "triton_speedup" in r:
            rows.append([f"vision attention {r['case']}: best torch ms / Triton ms",
                         round(r["triton_speedup"], 2)])
    for t in towers:
        for key, value in t.items():
            if key.endswith("_images_per_s") or "_over_hf_" in key:
                rows.append([f"{t['preset']} tower {key}", round(value, 2)])
    return rows


def run(args: argparse.Namespace) -> dict:
    from bench.report import print_table, save_result

    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    batches = [int(b) for b in args.batches.split(",") if b]
    started = time.perf_counter()
    tiles = candidate_tiles() if args.sweep else None
    kernels = []
    for case in default_cases(batches):
        within = time.perf_counter() - started < args.sweep_budget_s  # the section's time stays bounded
        row = measure_case(case, device, dtype, tiles if within else None)
        kernels.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        line = f"  {case.name}: " + ", ".join(f"{n} {_cell(b)}" for n, b in row["backends"].items())
        if row.get("sweep"):
            line += f"; sweep best {_tiles(row['sweep'][0])} {_cell(row['sweep'][0])}"
        print(line, flush=True)
    kernel_seconds = time.perf_counter() - started
    save_result("vision_attention", args, {"kernels": kernels, "towers": []},  # kept if the towers overrun
                headline=headline(kernels, []), peak_tflops=PEAK_TFLOPS, seconds=kernel_seconds)
    names = sorted({n for r in kernels for n in r["backends"]})
    print_table("vision attention: ms (TFLOP/s, % of 989)", ["case", *names, "sweep best"],
                [[r["case"], *[_cell(r["backends"].get(n)) for n in names],
                  f"{_tiles(r['sweep'][0])} {_cell(r['sweep'][0])}" if r.get("sweep") else "-"]
                 for r in kernels])
    towers = []
    for preset in [p for p in args.towers.split(",") if p and p != "none"]:
        towers.append(tower_figures(preset, device, dtype, batches, args.rounds, hf=not args.no_hf))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    elapsed = time.perf_counter() - started
    print(f"{elapsed:.0f} s ({kernel_seconds:.0f} s the kernels, compiles included)")
    return save_result("vision_attention", args, {"kernels": kernels, "towers": towers},
                       headline=headline(kernels, towers), peak_tflops=PEAK_TFLOPS, seconds=elapsed)


def _tiles(entry: dict) -> str:
    return "{block_m}x{block_n} w{num_warps} s{num_stages}".format(**entry)


def _cell(b: dict | None) -> str:
    if not b:
        return "-"
    if "ms" not in b:
        return "err" if "error" in b else f"err {b.get('err', 0):.1e}"
    return f"{b['ms']:.3f} ({b['tflops']:.0f}, {b['pct_peak']:.0f}%)"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vision_attention", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", default="1,8", help="images per kernel case and tower batch sizes")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also time every candidate tile of the Triton kernel")
    p.add_argument("--sweep-budget-s", type=float, default=90.0,
                   help="no sweep for the cases that start after this many seconds")
    p.add_argument("--towers", default="qwen3-vl-8b,qwen2.5-vl-7b", help="presets, or none")
    p.add_argument("--rounds", type=int, default=5, help="timed tower rounds per figure")
    p.add_argument("--no-hf", action="store_true", help="skip HF's towers")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if torch.device(args.device).type != "cuda":
        raise SystemExit("bench.vision_attention times CUDA kernels (tests run measure_case on the CPU)")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
