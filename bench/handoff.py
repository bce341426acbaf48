"""Handoff micro-benchmark: from the Encode RPC to the embedding tensor ready on the reader's device.

    python -m bench.handoff --model DIR [--device cuda --dtype bfloat16] [--out handoff.json]
    python -m bench.handoff --preset tiny
    python -m bench.handoff --encoder 127.0.0.1:50051 --device cpu

Times cache hits requested by content hash, so the vision tower is out of the picture, for every
transport the encoder serves and this process can read: CUDA IPC (GPU encoder with a cupy arena), shared
memory, NIXL (with --nixl and the nixl extra: the spawned encoders register their arenas with a NIXL agent)
and inline bytes. With --model it starts one encoder per arena kind (cuda and shm on a GPU, shm on a CPU).
The first import of a zero-copy ref opens the arena (CUDA IPC: cudaIpcOpenMemHandle; SHM: mmap; NIXL: the
agent's metadata) once per process: that first call is reported separately from the per-entry times.

Where the time of a hit goes: spawned encoders export /metrics, and the benchmark reads their Encode
handler time (the latency histogram, cache="hit") around the timed calls, so the table splits the RPC
into the encoder's handler and the rest (gRPC on both sides, the network stack, the client stub).
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Sequence

import torch

from bench.embeds import TRANSPORT_NAMES, encode_and_import, sync
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import encoder_service, exit_on_sigterm, free_port, workdir
from bench.stats import summarize
from bench.workload import random_png
from common.client import EncoderClient
from common.transport.importer import readable_transports
from common.transport.shm import shm_available, shm_free_bytes


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the handoff benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__.split("\n")[0])
    p.add_argument("--encoder", default=None, help="a running encoder (otherwise --model spawns them)")
    add_model_args(p)
    p.add_argument("--arenas", default=None, help="arena kinds to spawn, comma-separated "
                   "(default: cuda,shm on a GPU, shm on a CPU)")
    p.add_argument("--nixl", action="store_true", help="spawned encoders also offer NIXL (--nixl)")
    p.add_argument("--iters", type=int, default=30, help="timed handoffs per transport")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    return p


def handler_seconds(metrics_url: str | None) -> tuple[float, float] | None:
    """(sum, count) of the encoder's Encode handler time on cache hits, from its /metrics; None when
    the encoder exports none."""
    if metrics_url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "mmserve_encoder_encode_latency_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("cache") != "hit":
                continue
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return total, count


def handler_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean handler time, in ms, of the hits between two handler_seconds readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1000


def bench_encoder(address: str, label: str, device: torch.device, iters: int, image: bytes,
                  metrics_url: str | None = None) -> list[dict]:
    """Time every readable transport of one encoder; one result dict per transport it really served."""
    out = []
    with EncoderClient(address, timeout=120) as client:
        first = encode_and_import(client, image, [readable_transports(device)[-1]], device)  # a miss
        by_hash = f"hash:{first.content_hash}"
        floor = []  # a Lookup of the same hash: the RPC round trip with no lease, ref or import
        for _ in range(iters):
            t0 = time.perf_counter()
            client.lookup([first.content_hash])
            floor.append(time.perf_counter() - t0)
        for transport in readable_transports(device):
            opening = encode_and_import(client, by_hash, [transport], device)
            if opening.transport != transport:
                continue  # this encoder does not serve it (answered inline instead)
            before = handler_seconds(metrics_url)
            runs = [encode_and_import(client, by_hash, [transport], device) for _ in range(iters)]
            handler = handler_ms(before, handler_seconds(metrics_url))
            out.append({
                "encoder": label, "transport": TRANSPORT_NAMES[transport], "nbytes": first.nbytes,
                "shape": list(first.shape), "iters": iters,
                "first_call_ms": opening.total_s * 1000, "first_import_ms": opening.import_s * 1000,
                "rpc": summarize([r.rpc_s for r in runs]), "import": summarize([r.import_s for r in runs]),
                "total": summarize([r.total_s for r in runs]), "lookup_rpc": summarize(floor),
                "all_cache_hits": all(r.cache_hit for r in runs),
                "encode_handler_mean_ms": handler,
            })
    return out


def default_arenas(device: torch.device) -> list[str]:
    """cuda and shm arenas on a GPU, shm on a CPU (private when /dev/shm is missing)."""
    kinds = ["cuda"] if device.type == "cuda" else []
    return kinds + (["shm"] if shm_available() else ["private"])


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # create the CUDA context before anything is timed
        sync(device)
    image = random_png(4242, args.image_size)
    results = []
    if args.encoder:
        results += bench_encoder(args.encoder, "given", device, args.iters, image)
    else:
        model = resolve_model(args)
        logs = workdir(args.logs)
        kinds = args.arenas.split(",") if args.arenas else default_arenas(device)
        services = []
        for kind in kinds:
            extra = ["--arena", kind, "--metrics-port", str(free_port())] + (["--nixl"] if args.nixl else [])
            if kind == "shm":  # containers often have a small /dev/shm
                extra += ["--cache-bytes", str(min(256 << 20, shm_free_bytes() // 2))]
            services.append(encoder_service(model, logs, args.device, args.dtype, extra,
                                            name=f"encoder-{kind}"))
        exit_on_sigterm()
        for svc in services:
            svc.launch()
        try:
            for kind, svc in zip(kinds, services, strict=True):
                try:
                    svc.wait(300)
                except RuntimeError as exc:  # e.g. no cupy: report it, still time the other arenas
                    results.append({"encoder": f"{kind} arena", "error": str(exc)[-1500:]})
                    continue
                metrics_port = svc.argv[svc.argv.index("--metrics-port") + 1]
                results += bench_encoder(svc.address, f"{kind} arena", device, args.iters, image,
                                         f"http://127.0.0.1:{metrics_port}/metrics")
        finally:
            for svc in services:
                svc.stop()
    for r in results:
        if "error" in r:
            print(f"{r['encoder']}: failed to start:\n{r['error']}")
    results_ok = [r for r in results if "error" not in r]
    rows = [[f"{r['transport']} ({r['encoder']})", r["nbytes"], r["first_call_ms"], r["total"]["mean_ms"],
             r["total"]["p50_ms"], r["total"]["p99_ms"], r["rpc"]["p50_ms"], r["import"]["p50_ms"],
             r["lookup_rpc"]["p50_ms"], r.get("encode_handler_mean_ms")] for r in results_ok]
    print_table(f"handoff on {device}: Encode (cache hit) -> tensor ready, ms",
                ["transport", "bytes", "first call", "mean", "p50", "p99", "Encode p50", "import p50",
                 "Lookup p50", "handler mean"], rows)
    return save_result("handoff", args, results)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
