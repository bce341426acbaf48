"""Encoder throughput: distinct images through Encode at rising concurrency, against HF batched.

    python -m bench.encode_tput --preset tiny --images 32                         (CPU smoke)
    python -m bench.encode_tput --model /tmp/llava7b --device cuda --dtype bfloat16 --out tput.json
    python -m bench.encode_tput --preset llava-1.5-tiny --preprocess torch --decode-processes 0,8
                                          (CPU, 336px tower input: the host path, threads vs processes)

Every request is one new image (a distinct size x size PNG: always a cache miss), sent by `c` concurrent
clients over gRPC; on CUDA the reply is a CUDA IPC ref released at once, on CPU the embedding comes
inline. The reference is Hugging Face on the same checkpoint in the same run: the image processor
(from PIL images, as the encoder gets them after decoding) plus `get_image_features`, in batches of
1 and 32; and, as the ceiling, the encoder's own tower on prepared images at the largest batch. Also
measured: the host-side costs per image (decode, hash with blake3 and sha256, the HF
processor, the uint8 copy the torch preprocessing starts from), and how much a thread pool speeds
decode + hash + HF preprocessing up (it only can where Pillow and numpy drop the GIL).

With a spawned encoder, each level also reports the encoder's CPU time per image (from /proc, Linux):
its main process (gRPC, cache, worker threads: one interpreter, so this is the part the GIL can
serialise) apart from its decode processes. `--decode-processes 0,8` spawns one encoder per value and
runs the levels on each, side by side (the targets use the last).

The issue-16 targets are printed: Encode at 64 clients >= 1.5x HF batch 32, Encode p50 at 1 client <=
HF batch-1 time per image.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch
from PIL import Image

from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import encoder_service, workdir
from bench.stats import ratio, summarize
from bench.workload import random_png
from common.checkpoint import parse_dtype
from common.client import new_lease_owner
from common.hashing import hash_algorithm, hash_image
from common.images import ImageLimits, decode_image, decode_image_array
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from encoder_svc.decode_pool import DecodePool
from encoder_svc.decoded_image import decode_and_hash

MAX_MESSAGE = 64 << 20
TRANSPORTS = {"inline": common_pb2.TRANSPORT_INLINE, "shm": common_pb2.TRANSPORT_SHM,
              "cuda_ipc": common_pb2.TRANSPORT_CUDA_IPC}


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the encoder-throughput benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.encode_tput", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--encoder", default=None, help="a running encoder (otherwise one is spawned)")
    p.add_argument("--images", type=int, default=256, help="distinct images per concurrency level")
    p.add_argument("--image-size", type=int, default=336, help="side of the random PNGs")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts")
    p.add_argument("--hf-batches", default="1,32", help="comma-separated HF batch sizes ('' skips HF)")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels the clients share")
    p.add_argument("--max-batch-images", type=int, default=None, help="passed to a spawned encoder")
    p.add_argument("--preprocess", default=None, help="passed to a spawned encoder (auto, hf, torch)")
    p.add_argument("--decode-processes", default=None,
                   help="comma-separated --decode-processes values: one spawned encoder each, run side by "
                   "side (0: decode in threads); default: the encoder's own default")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="a spawned encoder's cache (default 2 GiB on CUDA: 2 leased 7B embeddings of "
                   "4.7 MB per client; 256 MiB on CPU)")
    p.add_argument("--transport", default=None, choices=sorted(TRANSPORTS),
                   help="how embeddings come back (default: cuda_ipc on CUDA, inline on CPU); shm and "
                   "cuda_ipc take a lease that each client releases with its own Release call")
    p.add_argument("--host-threads", type=int, default=8, help="threads for the host-cost scaling run")
    p.add_argument("--seed", type=int, default=0, help="image seed: change it to miss on a warm encoder")
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    return p


def make_pngs(count: int, size: int, seed: int) -> list[bytes]:
    """count distinct noise PNGs (every one a different content hash)."""
    return [random_png(seed * 1_000_003 + i, size) for i in range(count)]


# -- the encoder's CPU time ----------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def encoder_cpu(pid: int | None) -> dict[str, float] | None:
    """CPU seconds so far of the encoder's main process and of its child (decode) processes; None when
    unknown (a running --encoder, or no /proc)."""
    if pid is None or not Path(f"/proc/{pid}/stat").exists():
        return None
    children = 0.0
    for child in _children(pid):
        try:
            children += _proc_cpu_s(child)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            pass
    return {"main": _proc_cpu_s(pid), "children": children}


def _cpu_fields(before: dict | None, after: dict | None, images: int, wall: float) -> dict:
    if before is None or after is None:
        return {}
    main, children = after["main"] - before["main"], max(0.0, after["children"] - before["children"])
    return {"server_main_cpu_ms_per_image": 1000 * main / images, "server_main_cores": main / wall,
            "decode_procs_cpu_ms_per_image": 1000 * children / images}


# -- Encode over gRPC ------------------------------------------------------------------------------

def _wait_for_gpu(refs: list) -> bool:
    """Wait until the embeddings of refs are written on the encoder's GPU (their producer events), so a
    level's time covers the tower's work and not only its launch. False when they cannot be imported
    here (no cupy)."""
    from common.transport import import_embedding

    try:
        for ref in refs:
            import_embedding(ref, device=torch.device("cuda", torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - report, do not fail the run
        print(f"  (cannot wait for the encoder's GPU: {type(exc).__name__}: {exc})", flush=True)
        return False
    torch.cuda.synchronize()
    return True


async def _encode_level(address: str, pngs: Sequence[bytes], concurrency: int, accept: list[int],
                        channels: int) -> dict:
    """Send every png as its own Encode from `concurrency` clients; release each lease at once (each
    client's last one after its embedding is ready, on CUDA)."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    chans = [grpc.aio.insecure_channel(address, options=opts) for _ in range(max(1, channels))]
    stubs = [encoder_pb2_grpc.EncoderServiceStub(c) for c in chans]
    owner = new_lease_owner()
    queue = list(reversed(pngs))
    latencies: list[float] = []
    finished: list[float] = []  # when each reply came
    last: list = []  # each client's final ref, kept leased until the GPU has written it
    hits = 0
    cuda = accept[0] == common_pb2.TRANSPORT_CUDA_IPC

    async def release(stub, refs) -> None:
        ids = [r.lease_id for r in refs if r.lease_id]
        if ids:
            await stub.Release(encoder_pb2.ReleaseRequest(lease_ids=ids, lease_owner=owner), timeout=30)

    async def client(idx: int) -> None:
        nonlocal hits
        stub = stubs[idx % len(stubs)]
        while queue:
            data = queue.pop()
            t0 = time.perf_counter()
            resp = await stub.Encode(encoder_pb2.EncodeRequest(
                images=[common_pb2.ImageInput(data=data)], accept=accept, lease_owner=owner), timeout=120)
            finished.append(time.perf_counter())
            latencies.append(finished[-1] - t0)
            hits += sum(r.cache_hit for r in resp.embeddings)
            if cuda and not queue:
                last.extend(resp.embeddings)
            else:
                await release(stub, resp.embeddings)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    replied = time.perf_counter()
    synced = await asyncio.to_thread(_wait_for_gpu, last) if last else None
    wall = time.perf_counter() - t0
    await release(stubs[0], last)
    for c in chans:
        await c.close()
    return {"concurrency": concurrency, "images": len(pngs), "wall_s": wall, "waited_for_gpu": synced,
            "images_per_s": len(pngs) / wall, "steady_images_per_s": steady_rate(finished),
            # where a short level's time goes: the first reply (connections, the first batch), and the
            # wait for the GPU after the last reply
            "first_reply_ms": 1000 * (min(finished) - t0), "gpu_wait_ms": 1000 * (wall - (replied - t0)),
            "latency": summarize(latencies), "cache_hits": hits}


def steady_rate(finished: list[float], edge: float = 0.1) -> float | None:
    """Replies per second between the first and last `edge` of them: the rate once the clients' first
    requests are in and before the queue drains (a short level's images/s includes both). None for
    fewer than 10 replies."""
    if len(finished) < 10:
        return None
    times = sorted(finished)
    lo, hi = int(edge * len(times)), int((1 - edge) * len(times)) - 1
    span = times[hi] - times[lo]
    return (hi - lo) / span if span > 0 else None


def encoder_stats(address: str) -> dict:
    """The encoder's GetStats as a dict."""
    from google.protobuf.json_format import MessageToDict

    with grpc.insecure_channel(address) as ch:
        stats = encoder_pb2_grpc.EncoderServiceStub(ch).GetStats(common_pb2.StatsRequest(), timeout=10)
    return MessageToDict(stats, preserving_proto_field_name=True)


def run_encode(args: argparse.Namespace, address: str, levels: list[int], accept: list[int],
               pid: int | None = None, label: str = "") -> list[dict]:
    """One level per concurrency, each on its own fresh images (warm-up level first, not reported);
    with the encoder's pid, its CPU time per image too."""
    asyncio.run(_encode_level(address, make_pngs(max(levels), args.image_size, args.seed + 99), max(levels),
                              accept, args.channels))
    out = []
    for n, c in enumerate(levels):
        pngs = make_pngs(args.images, args.image_size, args.seed + 1 + n)
        before = encoder_cpu(pid)
        level = asyncio.run(_encode_level(address, pngs, c, accept, args.channels))
        level.update(_cpu_fields(before, encoder_cpu(pid), len(pngs), level["wall_s"]))
        out.append(level)
        cpu = (f", encoder main process {level['server_main_cpu_ms_per_image']:.2f} ms CPU per image "
               f"({level['server_main_cores']:.2f} cores), decode processes "
               f"{level['decode_procs_cpu_ms_per_image']:.2f} ms" if "server_main_cores" in level else "")
        steady = level["steady_images_per_s"]
        steady = f" (steady {steady:.1f})" if steady else ""
        print(f"  encode{label} c={c}: {level['images_per_s']:.1f} images/s{steady}, "
              f"p50 {level['latency']['p50_ms']:.2f} ms, first reply {level['first_reply_ms']:.1f} ms, "
              f"GPU wait {level['gpu_wait_ms']:.1f} ms{cpu}", flush=True)
    return out


# -- the HF reference ------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(args: argparse.Namespace, model_dir, batches: list[int], images: list[Image.Image]
           ) -> tuple[list[dict], str]:
    """HF image processor + get_image_features per batch size, over the same decoded images; and the
    processor's class name."""
    import transformers

    from bench.hf_ref import hf_image_features, hf_image_processor
    from common.families.registry import family_of_model

    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype)
    kw = {"device_map": str(device)} if device.type == "cuda" else {}
    cls = getattr(transformers, family_of_model(model_dir).hf_class)
    model = cls.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True, **kw).to(device).eval()
    processor = hf_image_processor(model_dir)
    cfg = model.config
    # LLaVA's feature layer and selection are call arguments; other families read their config.
    feature_kw = {"vision_feature_layer": cfg.vision_feature_layer,
                  "vision_feature_select_strategy": cfg.vision_feature_select_strategy
                  } if hasattr(cfg, "vision_feature_select_strategy") else {}

    def step(chunk: list[Image.Image]) -> None:
        pixels = processor(images=chunk, return_tensors="pt")
        with torch.inference_mode():
            hf_image_features(model, pixels, device, dtype, feature_kw)
        _sync(device)

    out = []
    for b in batches:
        step(images[:b])  # warm-up: kernels, allocator
        calls = []
        t0 = time.perf_counter()
        for i in range(0, len(images), b):
            t1 = time.perf_counter()
            step(images[i:i + b])
            calls.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        out.append({"batch": b, "images": len(images), "wall_s": wall, "images_per_s": len(images) / wall,
                    "ms_per_image": 1000 * wall / len(images), "call": summarize(calls)})
        print(f"  hf batch {b}: {out[-1]['images_per_s']:.1f} images/s", flush=True)
    return out, type(processor).__name__


def run_tower(args: argparse.Namespace, model_dir, batch: int, images: list[Image.Image]) -> dict:
    """The encoder's tower alone (mmserve's VisionEncoder, its CUDA graphs on CUDA), on images already
    through `prepare`, in batches of `batch`: the ceiling of Encode without gRPC, decode or hashing."""
    from common.families.registry import family_of_model

    device = torch.device(args.device)
    vision = family_of_model(model_dir).make_vision_encoder(model_dir, device, parse_dtype(args.dtype),
                                                             preprocess=args.preprocess or "auto")
    graphs = vision.capture_graphs(batch)
    prepared = [vision.prepare(img) for img in images]

    def step(chunk) -> None:
        vision.encode_prepared(chunk, use_graphs=graphs)
        _sync(device)

    step(prepared[:batch])  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(prepared), batch):
        step(prepared[i:i + batch])
    wall = time.perf_counter() - t0
    out = {"batch": batch, "images": len(images), "cuda_graphs": bool(graphs), "wall_s": wall,
           "images_per_s": len(images) / wall}
    print(f"  tower alone, batch {batch}: {out['images_per_s']:.1f} images/s", flush=True)
    return out


# -- host-side costs -------------------------------------------------------------------------------

def _per_image_ms(fn, items) -> float:
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    return 1000 * (time.perf_counter() - t0) / len(items)


def run_host_costs(args: argparse.Namespace, model_dir, pngs: list[bytes], threads: int) -> dict:
    """Per-image host costs, one thread; then decode + hash + HF preprocessing over a thread pool."""
    from bench.hf_ref import hf_image_processor
    from common.vision.pixels import to_uint8_hwc

    processor = hf_image_processor(model_dir)
    images = [decode_image(p) for p in pngs]
    fingerprint = "bench"

    def sha256(img: Image.Image) -> None:
        hashlib.sha256(img.tobytes()).digest()

    def hf_prepare(img: Image.Image) -> None:
        processor(images=[img], return_tensors="pt")

    def with_hf(png: bytes) -> None:  # the server's decode thread, then --preprocess hf's pool
        img = decode_image(png)
        hash_image(img, fingerprint)
        hf_prepare(img)

    def with_torch(png: bytes) -> None:  # the same with --preprocess torch (the rest runs on the GPU)
        img = decode_image(png)
        hash_image(img, fingerprint)
        to_uint8_hwc(img)

    costs = {
        "decode_png_ms": _per_image_ms(decode_image, pngs),
        # The encoder's own decode: libspng for plain RGB PNGs (common/images.decode_image_array).
        "decode_png_array_ms": _per_image_ms(decode_image_array, pngs),
        f"hash_{hash_algorithm()}_ms": _per_image_ms(lambda i: hash_image(i, fingerprint), images),
        "hash_sha256_ms": _per_image_ms(sha256, images),
        "tobytes_ms": _per_image_ms(lambda i: i.tobytes(), images),
        "hf_processor_ms": _per_image_ms(hf_prepare, images),
        "uint8_tensor_ms": _per_image_ms(to_uint8_hwc, images),
    }
    scaling = {}
    # Threads speed a step up only as far as it runs without the GIL (Pillow's decode, the hash, numpy).
    for name, fn in (("decode_hash_hf", with_hf), ("decode_hash_uint8", with_torch)):
        single = _per_image_ms(fn, pngs)
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, pngs[:threads]))  # start the threads
            t0 = time.perf_counter()
            list(pool.map(fn, pngs))
            pooled = 1000 * (time.perf_counter() - t0) / len(pngs)
        scaling[name] = {"1_thread_ms": single, "pool_ms": pooled, "speedup": single / pooled}
    # Decode + hash in threads (as the server's to_thread does) and in as many processes
    # (encoder_svc/decode_pool.py): the wall time, and this process's CPU per image, which in the server
    # is the part that shares the GIL with gRPC and the tower thread.
    single = _per_image_ms(lambda p: decode_and_hash(p, ImageLimits(), fingerprint, ""), pngs)
    with cf.ThreadPoolExecutor(threads) as tpool:
        list(tpool.map(lambda p: decode_and_hash(p, ImageLimits(), fingerprint, ""), pngs[:threads]))
        c0, t0 = time.process_time(), time.perf_counter()
        list(tpool.map(lambda p: decode_and_hash(p, ImageLimits(), fingerprint, ""), pngs))
        in_threads = _ms_per_image(t0, c0, len(pngs))
    pool = DecodePool(threads)
    try:
        pool.start()
        c0, t0 = time.process_time(), time.perf_counter()
        asyncio.run(_decode_all_in(pool, pngs, fingerprint))
        in_procs = _ms_per_image(t0, c0, len(pngs))
    finally:
        pool.close()
    scaling["decode_hash_threads"] = {"1_thread_ms": single, "pool_ms": in_threads[0],
                                      "speedup": single / in_threads[0], "caller_cpu_ms": in_threads[1]}
    scaling["decode_hash_processes"] = {"1_thread_ms": single, "pool_ms": in_procs[0],
                                        "speedup": single / in_procs[0], "caller_cpu_ms": in_procs[1]}
    return {"per_image": costs, "threads": threads, "scaling": scaling, "hash": hash_algorithm()}


def _ms_per_image(wall0: float, cpu0: float, n: int) -> tuple[float, float]:
    """(wall ms, this process's CPU ms) per image since (wall0, cpu0)."""
    return 1000 * (time.perf_counter() - wall0) / n, 1000 * (time.process_time() - cpu0) / n


async def _decode_all_in(pool, pngs: list[bytes], fingerprint: str) -> None:
    await asyncio.gather(*(pool.decode(p, fingerprint, "") for p in pngs))


# -- main ------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _encode_on(args: argparse.Namespace, model_dir, device: torch.device, levels: list[int],
               accept: list[int], extra: list[str], label: str) -> tuple[list[dict], dict, str | None]:
    """The Encode levels on args.encoder, or on an encoder spawned with extra flags: (levels, the
    encoder's stats, a spawned encoder's log tail)."""
    svc = None
    encoder_log = None
    address = args.encoder
    if address is None:
        cache = args.cache_bytes or (2 << 30 if device.type == "cuda" else 256 << 20)
        svc = encoder_service(model_dir, workdir(args.logs), args.device, args.dtype,
                              extra=["--log-level", "WARNING", "--cache-bytes", str(cache), *extra]).start()
        address = svc.address
    try:
        print(f"encode via {address}{label}", flush=True)
        encode = run_encode(args, address, levels, accept, svc.proc.pid if svc else None, label)
        stats = encoder_stats(address)
    finally:
        if svc is not None:
            svc.stop()
            encoder_log = svc.log_tail(20)  # warnings only: e.g. a CUDA graph capture that failed
    return encode, stats, encoder_log


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    model_dir = resolve_model(args)
    device = torch.device(args.device)
    levels, hf_batches = _ints(args.concurrency), _ints(args.hf_batches)
    transport = args.transport or ("cuda_ipc" if device.type == "cuda" else "inline")
    accept = [TRANSPORTS[transport]]

    print("host costs", flush=True)
    host = run_host_costs(args, model_dir, make_pngs(min(args.images, 64), args.image_size, args.seed + 50),
                          args.host_threads)

    extra = []
    if args.max_batch_images:
        extra += ["--max-batch-images", str(args.max_batch_images)]
    if args.preprocess:
        extra += ["--preprocess", args.preprocess]
    variants = [None] if args.decode_processes is None or args.encoder else _ints(args.decode_processes)
    by_variant = {}
    for variant in variants:
        label = "" if variant is None or len(variants) == 1 else f" (decode-processes {variant})"
        more = [] if variant is None else ["--decode-processes", str(variant)]
        encode, stats, encoder_log = _encode_on(args, model_dir, device, levels, accept, extra + more, label)
        by_variant[str(variant)] = {"encode": encode, "encoder_stats": stats, "encoder_log": encoder_log}

    hf, hf_processor, tower = [], None, None
    if hf_batches:
        print("hf reference", flush=True)
        images = [decode_image(p) for p in make_pngs(args.images, args.image_size, args.seed + 77)]
        hf, hf_processor = run_hf(args, model_dir, hf_batches, images)
        tower = run_tower(args, model_dir, max(hf_batches), images)

    by_c = {r["concurrency"]: r for r in encode}
    by_b = {r["batch"]: r for r in hf}
    top_c = max(levels)
    best_hf = max((r["images_per_s"] for r in hf), default=None)
    targets = {
        f"encode_c{top_c}_vs_hf_batch32": ratio(by_c[top_c]["images_per_s"], by_b[32]["images_per_s"])
        if 32 in by_b else None,
        f"encode_c{top_c}_vs_best_hf": ratio(by_c[top_c]["images_per_s"], best_hf) if best_hf else None,
        # the same without the level's ramp-up and drain (see steady_rate): not the measure
        f"encode_c{top_c}_steady_vs_hf_batch32": ratio(by_c[top_c]["steady_images_per_s"],
                                                       by_b[32]["images_per_s"])
        if 32 in by_b and by_c[top_c]["steady_images_per_s"] else None,
        "encode_c1_p50_ms": by_c[1]["latency"]["p50_ms"] if 1 in by_c else None,
        "hf_batch1_ms_per_image": by_b[1]["ms_per_image"] if 1 in by_b else None,
    }
    if targets["encode_c1_p50_ms"] is not None and targets["hf_batch1_ms_per_image"]:
        targets["c1_p50_over_hf_batch1"] = targets["encode_c1_p50_ms"] / targets["hf_batch1_ms_per_image"]
    rows = []
    for variant, run_ in by_variant.items():
        label = "" if len(by_variant) == 1 else f" (decode-processes {variant})"
        rows += [[f"Encode{label}, {r['concurrency']} concurrent", r["images_per_s"],
                  r["steady_images_per_s"], r["latency"]["p50_ms"], r["latency"]["p99_ms"],
                  r.get("server_main_cpu_ms_per_image", ""), r.get("decode_procs_cpu_ms_per_image", "")]
                 for r in run_["encode"]]
    rows += [[f"HF, batch {r['batch']}", r["images_per_s"], "", r["call"]["p50_ms"], r["call"]["p99_ms"], "",
              ""] for r in hf]
    if tower:
        rows.append([f"tower alone, batch {tower['batch']}", tower["images_per_s"], "", "", "", "", ""])
    print_table(f"encoder throughput ({args.device}, {args.dtype}, {args.image_size}px PNGs)",
                ["", "images/s", "steady images/s", "p50 ms", "p99 ms", "main CPU ms/img",
                 "decode procs CPU ms/img"], rows)
    print_table("host costs per image (ms, one thread; then threads or processes)", ["step", "ms"],
                [[k, v] for k, v in host["per_image"].items()]
                + [[f"{name}, 1 / {host['threads']} threads or processes (speed-up)",
                    f"{r['1_thread_ms']:.3f} / {r['pool_ms']:.3f} ({r['speedup']:.2f}x)"
                    + (f", caller CPU {r['caller_cpu_ms']:.3f}" if "caller_cpu_ms" in r else "")]
                   for name, r in host["scaling"].items()])
    print_table("targets (issue 16)", ["", "value"], [[k, v] for k, v in targets.items()])
    results = {"encode": encode, "hf": hf, "tower": tower, "host": host, "targets": targets}
    if len(by_variant) > 1:
        results["encode_by_decode_processes"] = {k: v["encode"] for k, v in by_variant.items()}
    return save_result("encode_tput", args, results,
                       hf_processor=hf_processor, encoder_stats=stats, encoder_log=encoder_log,
                       model_dir=str(model_dir))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
