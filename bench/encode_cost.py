"""Where the encoder's CPU goes: misses, hits by bytes and hits by hash, by server thread.

    python -m bench.encode_cost --preset tiny --images 64                              (CPU smoke)
    python -m bench.encode_cost --model /tmp/llava7b --device cuda --dtype bfloat16 --images 400

One spawned encoder gets three kinds of request, `--images` of each from `--concurrency` clients on one
channel (every lease released at once, as a decoder does):
- miss: new image bytes (decode and hash, preprocessing, the tower, the cache write);
- hit by bytes: the same bytes again (decode and hash, then a cache hit);
- hit by hash: `content_hash` only (gRPC, the cache and the ref: the floor of any Encode).

For each: images/s, p50 latency, and the encoder's CPU time per image split by thread (Linux /proc:
the main thread runs the event loop; the encoder names its vision worker and preprocessing threads;
gRPC names its own). The main process is one interpreter, so what its Python threads spend per image
bounds its images/s; the decode processes are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch

from bench.encode_tput import MAX_MESSAGE, TRANSPORTS, encoder_cpu, make_pngs
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import encoder_service, workdir
from bench.stats import summarize
from common.client import new_lease_owner
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the encoder cost-split benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.encode_cost", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--images", type=int, default=400, help="requests of each kind (one image each)")
    p.add_argument("--image-size", type=int, default=336, help="side of the random PNGs")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent clients")
    p.add_argument("--decode-processes", type=int, default=None, help="passed to the encoder")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="the encoder's cache; it must hold every image for the hit levels (default "
                   "4 GiB on CUDA, 256 MiB on CPU)")
    p.add_argument("--transport", default=None, choices=sorted(TRANSPORTS),
                   help="default: cuda_ipc on CUDA, shm on CPU (both leased and released)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    return p


def thread_cpu(pid: int) -> Counter:
    """CPU seconds so far of each named thread group of process pid (the main thread as 'loop')."""
    out: Counter = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(task.name) == pid:
            name = "loop (main thread)"
        elif comm.startswith("python"):  # a thread nobody named: the interpreter's name
            name = "unnamed"
        else:
            name = comm.rstrip("0123456789_-") or comm
        out[name] += (int(fields[11]) + int(fields[12])) / _TICK
    return out


async def _level(address: str, inputs: list, concurrency: int, accept: list[int]) -> dict:
    """Send every input as its own Encode from `concurrency` clients; release each lease at once."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    owner = new_lease_owner()
    queue = list(reversed(inputs))
    latencies: list[float] = []
    hashes: list[str] = []
    hits = 0
    async with grpc.aio.insecure_channel(address, options=opts) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)

        async def client() -> None:
            nonlocal hits
            while queue:
                image = queue.pop()
                t0 = time.perf_counter()
                resp = await stub.Encode(encoder_pb2.EncodeRequest(images=[image], accept=accept,
                                                                   lease_owner=owner), timeout=120)
                latencies.append(time.perf_counter() - t0)
                hashes.append(resp.embeddings[0].content_hash)
                hits += sum(r.cache_hit for r in resp.embeddings)
                ids = [r.lease_id for r in resp.embeddings if r.lease_id]
                if ids:
                    await stub.Release(encoder_pb2.ReleaseRequest(lease_ids=ids, lease_owner=owner),
                                       timeout=30)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"images": len(inputs), "wall_s": wall, "images_per_s": len(inputs) / wall,
            "latency": summarize(latencies), "cache_hits": hits, "hashes": hashes}


def measure(address: str, pid: int, inputs: list, concurrency: int, accept: list[int]) -> dict:
    """One level, with the encoder's CPU per image by thread (and in its decode processes)."""
    before, procs_before = thread_cpu(pid), encoder_cpu(pid)
    level = asyncio.run(_level(address, inputs, concurrency, accept))
    after, procs_after = thread_cpu(pid), encoder_cpu(pid)
    n = level["images"]
    by_thread = {k: 1000 * (after[k] - before.get(k, 0.0)) / n for k in after}
    level["cpu_ms_per_image_by_thread"] = {k: v for k, v in sorted(by_thread.items()) if v > 0}
    level["main_process_cpu_ms_per_image"] = sum(by_thread.values())
    level["decode_procs_cpu_ms_per_image"] = 1000 * max(
        0.0, procs_after["children"] - procs_before["children"]) / n
    return level


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    model_dir = resolve_model(args)
    device = torch.device(args.device)
    accept = [TRANSPORTS[args.transport or ("cuda_ipc" if device.type == "cuda" else "shm")]]
    cache = args.cache_bytes or (4 << 30 if device.type == "cuda" else 256 << 20)
    extra = ["--log-level", "WARNING", "--cache-bytes", str(cache)]
    if args.decode_processes is not None:
        extra += ["--decode-processes", str(args.decode_processes)]
    svc = encoder_service(model_dir, workdir(args.logs), args.device, args.dtype, extra=extra).start()
    try:
        pid = svc.proc.pid
        warm = make_pngs(2 * args.concurrency, args.image_size, args.seed + 7)
        asyncio.run(_level(svc.address, [common_pb2.ImageInput(data=d) for d in warm], args.concurrency,
                           accept))
        data = [common_pb2.ImageInput(data=d)
                for d in make_pngs(args.images, args.image_size, args.seed + 1)]
        levels = {"miss": measure(svc.address, pid, data, args.concurrency, accept)}
        levels["hit_by_bytes"] = measure(svc.address, pid, data, args.concurrency, accept)
        by_hash = [common_pb2.ImageInput(content_hash=h) for h in levels["miss"]["hashes"]]
        levels["hit_by_hash"] = measure(svc.address, pid, by_hash, args.concurrency, accept)
    finally:
        svc.stop()
    for level in levels.values():
        del level["hashes"]
    print_table(f"encoder CPU by request kind ({args.device}, {args.dtype}, {args.image_size}px PNGs, "
                f"{args.concurrency} clients)",
                ["", "images/s", "p50 ms", "main CPU ms/img", "by thread (ms/img)", "decode procs ms/img"],
                [[kind, r["images_per_s"], r["latency"]["p50_ms"], r["main_process_cpu_ms_per_image"],
                  ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_image_by_thread"].items()),
                  r["decode_procs_cpu_ms_per_image"]] for kind, r in levels.items()])
    return save_result("encode_cost", args, levels, model_dir=str(model_dir))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
