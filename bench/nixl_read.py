"""NIXL READ micro-benchmark: one embedding READ from an encoder-like process's arena, no gRPC around it.

    python -m bench.nixl_read [--shape 1369x3584] [--arenas cuda,private] [--readers cuda,cpu]
    UCX_PROTO_INFO=y python -m bench.nixl_read ...      (UCX prints the protocols it picked)

A spawned process stands for the encoder: an arena (a CUDA arena registered as VRAM, or a private host
arena as DRAM) holding one bf16 embedding of --shape, a NIXL agent (common.transport.nixl.NixlExporter,
its progress poll every --progress-us) and the ref an Encode would hand out. This process READs it
--iters times with the decoder's reader into each --readers device and reports the first READ (the
remote agent's metadata loaded, connections made) apart from the rest, with GB/s. What bench.handoff
adds on top is the Encode RPC and the lease; what the UCX settings in the environment change shows here
first.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections.abc import Sequence

import torch

from bench.report import print_table, save_result
from bench.stats import summarize


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the NIXL READ benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.nixl_read", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1369x3584", help="rows x hidden of the bf16 embedding")
    p.add_argument("--arenas", default=None, help="cuda and/or private (default: both on a GPU host)")
    p.add_argument("--readers", default=None, help="cuda and/or cpu (default: both on a GPU host)")
    p.add_argument("--progress-us", type=float, default=None,
                   help="the encoder agent's progress poll interval, fixed (default: the exporter's "
                   "own: fast for a while after a ref is handed out, slow otherwise)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="recorded with the result (the readers choose the devices)")
    p.add_argument("--out", default=None)
    return p


def _rows(shape: tuple[int, int]) -> torch.Tensor:
    """The embedding's values: every bf16 bit pattern of 0..250, so a wrong or partial READ shows."""
    values = torch.arange(shape[0] * shape[1], dtype=torch.float32).remainder_(251)
    return values.to(torch.bfloat16).view(shape)


def _encoder(kind: str, shape: tuple[int, int], progress_s: float | None, refs, done) -> None:
    """Stands for an encoder: one entry in a `kind` arena, registered with NIXL; puts the entry's ref."""
    from common.pb import common_pb2
    from common.transport import nixl
    from encoder_svc.cache import EmbeddingCache
    from encoder_svc.refs import build_ref

    if progress_s is not None:  # one fixed interval, idle or not
        nixl._PROGRESS_S = nixl._BUSY_PROGRESS_S = progress_s
    nbytes = shape[0] * shape[1] * 2
    if kind == "cuda":
        from common.transport.cuda_ipc import CudaArena

        torch.cuda.init()
        arena, device = CudaArena(2 * nbytes + (1 << 20), "cuda:0"), "cuda:0"
    else:
        from common.transport.arena import TensorArena

        arena, device = TensorArena(2 * nbytes + (1 << 20)), "cpu"
    cache = EmbeddingCache(arena)
    exporter = nixl.NixlExporter(arena)
    fut, produce = cache.acquire("e", True, expected_nbytes=nbytes)
    assert produce
    cache.complete_many([("e", _rows(shape).to(device))], [(1, 2, 2)])
    refs.put(build_ref(fut.result(0), common_pb2.TRANSPORT_NIXL, arena, nixl=exporter).SerializeToString())
    done.wait(300)
    exporter.close()
    cache.close()


def bench_arena(kind: str, shape: tuple[int, int], readers: list[str],
                args: argparse.Namespace) -> list[dict]:
    """Spawn the encoder side with a `kind` arena and time READs into every reader device."""
    from common.pb import common_pb2
    from common.transport import nixl

    progress_s = args.progress_us / 1e6 if args.progress_us is not None else None
    ctx = mp.get_context("spawn")
    refs, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder, args=(kind, shape, progress_s, refs, done), daemon=True)
    proc.start()
    out = []
    try:
        ref = common_pb2.EmbeddingRef.FromString(refs.get(timeout=300))
        expected = _rows(shape).view(-1).view(torch.uint8)
        for reader in readers:
            device = torch.device(reader)
            times = []
            for _ in range(args.iters + 1):
                t0 = time.perf_counter()
                raw = nixl.read_slice(ref.nixl, ref.nbytes, source=f"bench-{kind}", device=device)
                times.append(time.perf_counter() - t0)
            later = summarize(times[1:])
            out.append({"arena": kind, "reader": reader, "nbytes": ref.nbytes, "first_ms": times[0] * 1000,
                        "read": later, "gb_per_s": ref.nbytes / (later["p50_ms"] / 1000) / 1e9,
                        "bytes_equal": bool(torch.equal(raw.cpu(), expected))})
    finally:
        done.set()
        proc.join(30)
    return out


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    shape = tuple(int(x) for x in args.shape.split("x"))
    gpu = torch.cuda.is_available()
    arenas = args.arenas.split(",") if args.arenas else (["cuda", "private"] if gpu else ["private"])
    readers = args.readers.split(",") if args.readers else (["cuda", "cpu"] if gpu else ["cpu"])
    if gpu:
        torch.zeros(1, device="cuda")  # the CUDA context before anything is timed
    results = []
    for kind in arenas:
        results += bench_arena(kind, shape, readers, args)
    ucx = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    print_table(f"NIXL READ of {shape[0]}x{shape[1]} bf16, ms (UCX settings: {ucx or 'defaults'})",
                ["arena -> reader", "bytes", "first", "p50", "p99", "GB/s", "bytes equal"],
                [[f"{r['arena']} -> {r['reader']}", r["nbytes"], r["first_ms"], r["read"]["p50_ms"],
                  r["read"]["p99_ms"], r["gb_per_s"], r["bytes_equal"]] for r in results])
    return save_result("nixl_read", args, results, ucx_env=ucx)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
