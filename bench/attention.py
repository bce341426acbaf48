"""Decode attention over the paged KV cache, alone: time and KV bandwidth per (family, batch, context) for
the decoder's own launch and for every key-tile / warps / stages / splits candidate beside it.

    python -m bench.attention [--families all|llava-1.5-7b|...] [--batches 1,8,32] [--contexts 128,1024,4096]
                              [--out attention.json]

Heads first (the decoder's order) and by sequence (the order before) are both timed. A decode step's
attention reads every sequence's keys and values once: batch x context x KV heads x head dim x
2 (K, V) x 2 bytes, against the copy bandwidth measured in the same run. At short contexts the kernel's fixed
cost (a program's dependent loads: its sequence length, its block table, then the tiles) is what shows; at
long ones the bandwidth. Each case is timed as decode runs it (graph_timing.graph_time_us): the launches back
to back in a replayed CUDA graph, over enough copies of the KV pool (same block tables, a shuffled page order
as a long-running cache has) that they are not read from L2. Every candidate's output is compared with the
decoder's own launch (`err`: max abs difference; bf16, so splits and tiles differ in rounding only).

On a CPU (tests) `measure_case` runs the candidates in Triton's interpreter against the torch reference
instead of timing them. About 2 minutes on an H200 with a cold Triton cache (every family, the defaults).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# (query heads, KV heads, head dim) of the language models served.
FAMILIES = {"llava-1.5-7b": (32, 32, 128), "qwen2.5-vl-7b": (28, 4, 128), "qwen3-vl-8b": (32, 8, 128)}
PAGE = 16  # the decoder's KV block size (tokens)


@dataclass(frozen=True)
class Case:
    """One decode step's attention: `batch` sequences of `context` keys each, one query row each."""

    family: str
    batch: int
    context: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim)."""
        return FAMILIES[self.family]

    def kv_bytes(self, element_size: int) -> int:
        """The keys and values one step reads."""
        _, kv_heads, dim = self.shape
        return self.batch * self.context * kv_heads * dim * 2 * element_size


def candidate_tiles(block_ns: Sequence[int] = (32, 64, 128), warps: Sequence[int] = (4, 8),
                    stages: Sequence[int] = (2, 3)) -> list:
    """The key tiles, warps and stages swept beside the decoder's own choice, heads first; and each key
    tile at 4 warps and 2 stages with the programs ordered by sequence (the order before heads first)."""
    from common.kernels.attention import AttentionTiles

    tiles = [AttentionTiles(n, w, s) for n, w, s in itertools.product(block_ns, warps, stages)]
    return tiles + [AttentionTiles(n, 4, 2, heads_first=False) for n in block_ns]


def _pool(case: Case, copies: int, dtype: torch.dtype, device: torch.device, seed: int):
    """`copies` KV pools sharing one set of shuffled block tables, the query rows and the metadata."""
    from decoder_svc.model.attention import AttentionMetadata

    heads, kv_heads, dim = case.shape
    per_seq = -(-case.context // PAGE)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(case.batch * per_seq, generator=g).tolist()
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(case.batch)]
    slots = [t[(case.context - 1) // PAGE] * PAGE + (case.context - 1) % PAGE for t in tables]
    meta = AttentionMetadata.build(slots, [1] * case.batch, [case.context] * case.batch, tables, PAGE, device)
    shape = (2, case.batch * per_seq, PAGE, kv_heads, dim)
    pools = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(copies)]
    q = torch.randn(case.batch, heads, dim, generator=g).to(dtype).to(device)
    return pools, q, meta


def _split_choices(backend, q: torch.Tensor, pool: torch.Tensor, meta) -> list[int]:
    chosen = backend.num_splits(q, pool, meta)
    return sorted({chosen, 1, min(16, 2 * chosen), max(1, chosen // 2)})


def measure_case(case: Case, tiles: Sequence, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 copies: int = 1, bandwidth: float | None = None) -> dict:
    """The decoder's launch and every (tiles, splits) candidate for one case. On CUDA each is timed; on a
    CPU each is run once in Triton's interpreter and compared with the torch reference (`ref_err`)."""
    from common.kernels.attention import paged_attention
    from decoder_svc.model.attention import TorchAttentionBackend
    from decoder_svc.model.kernel_dispatch import TritonAttentionBackend

    cuda = device.type == "cuda"
    backend = TritonAttentionBackend()
    pools, q, meta = _pool(case, copies, dtype, device, seed=case.batch * 7 + case.context)
    scale = case.shape[2] ** -0.5
    out = torch.empty_like(q)
    default_splits = backend.num_splits(q, pools[0], meta)

    def launch(t, splits: int, pool: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, pool, meta, scale, splits, out=out, tiles=t)

    want = launch(None, default_splits, pools[0]).clone()
    row = {"family": case.family, "batch": case.batch, "context": case.context,
           "kv_bytes": case.kv_bytes(q.element_size()), "copies": copies, "default_splits": default_splits}
    if not cuda:  # the reference: the torch backend over the same cache (its new K/V already in place)
        k = pools[0][0].view(-1, *pools[0].shape[3:])[meta.slot_mapping]
        v = pools[0][1].view(-1, *pools[0].shape[3:])[meta.slot_mapping]
        ref = TorchAttentionBackend().forward(q, k, v, pools[0].clone(), meta, scale)
        row["default_ref_err"] = (want.float() - ref.float()).abs().max().item()
    candidates = []
    for t, splits in itertools.product(tiles, _split_choices(backend, q, pools[0], meta)):
        got = launch(t, splits, pools[0])
        cand = {"block_n": t.block_n, "num_warps": t.num_warps, "num_stages": t.num_stages,
                "heads_first": t.heads_first, "splits": splits,
                "err": (got.float() - want.float()).abs().max().item()}
        if cuda:
            cand["us"] = _time([lambda p=p, t=t, s=splits: launch(t, s, p) for p in pools])
        else:
            cand["ref_err"] = (got.float() - ref.float()).abs().max().item()
        candidates.append(cand)
    if cuda:
        row["default_us"] = _time([lambda p=p: launch(None, default_splits, p) for p in pools])
        best = min(candidates, key=lambda c: c["us"])
        row.update(best=best, best_speedup=row["default_us"] / best["us"],
                   default_gbps=row["kv_bytes"] / row["default_us"] / 1e3,
                   best_gbps=row["kv_bytes"] / best["us"] / 1e3)
        if bandwidth:
            row["default_of_copy"] = row["default_gbps"] * 1e9 / bandwidth
    row["candidates"] = candidates
    return row


def _time(calls) -> float:
    from common.kernels.graph_timing import graph_time_us

    return graph_time_us(calls)


def _copies(kv_bytes: int, l2: int) -> int:
    """Distinct KV pools one timing rotates over: at least 4, enough for 3x L2, at most 64."""
    return min(64, max(4, -(-3 * l2 // max(kv_bytes, 1))))


def run(args: argparse.Namespace) -> dict:
    """Every (family, batch, context) case; returns the JSON payload."""
    from bench.bandwidth import copy_bandwidth
    from bench.report import print_table, save_result

    dev = torch.device(args.device)
    if dev.type != "cuda":
        raise SystemExit("bench.attention times CUDA kernels (tests run measure_case on the CPU)")
    bandwidth = copy_bandwidth(args.device, 2 << 30)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    families = sorted(FAMILIES) if args.families == "all" else [args.families]
    tiles = candidate_tiles()
    started = time.perf_counter()
    results = []
    for family, batch, context in itertools.product(families, _ints(args.batches), _ints(args.contexts)):
        case = Case(family, batch, context)
        copies = _copies(case.kv_bytes(2), l2)
        results.append(measure_case(case, tiles, dev, copies=copies, bandwidth=bandwidth))
        torch.cuda.empty_cache()
    elapsed = time.perf_counter() - started
    print_table(f"decode attention (us, GB/s of K/V read), copy bandwidth {bandwidth / 1e9:.0f} GB/s",
                ["family", "batch", "context", "splits", "us", "GB/s", "of copy", "best us", "best GB/s",
                 "best (keys, warps, stages, heads first, splits)", "speed-up", "best err"],
                [[r["family"], r["batch"], r["context"], r["default_splits"], r["default_us"],
                  r["default_gbps"], r.get("default_of_copy"), r["best"]["us"], r["best_gbps"],
                  "{block_n}, {num_warps}, {num_stages}, {heads_first:d}, {splits}".format(**r["best"]),
                  r["best_speedup"],
                  r["best"]["err"]] for r in results])
    print(f"{elapsed:.0f} s (compiles included)")
    return save_result("attention", args, results, copy_bandwidth_bytes_per_s=bandwidth, l2_bytes=l2,
                       seconds=elapsed)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n")[0])
    p.add_argument("--families", default="all", choices=["all", *sorted(FAMILIES)])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="128,1024,4096")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
