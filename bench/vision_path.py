"""The Qwen vision path, end to end, in one run: the tower in-process (the reference path beside the fast
path, and Hugging Face's tower on the same weights), a profile of one fast forward, and the encoder
service through gRPC Encode (one client, 64 clients, a stream of mixed sizes, videos) with the
encoder's per-stage split from GetStats.

    python -m bench.vision_path --model /tmp/qwen7b --device cuda --dtype bfloat16 --out v.json
    python -m bench.vision_path --model /tmp/qwen-tiny --device cpu --dtype float32 --images 4 \\
        --clients 1,4 --image-size 224 --videos 1 --video-seconds 2 --video-size 112    (CPU smoke)

The workload is issue 37's: distinct 1024x1024 noise PNGs with `max_pixels` = 1280 merge blocks
(1280 x (2 x patch)^2: Qwen2.5-VL 70x70 patches = 1225 tokens, Qwen3-VL 64x64 = 1024 tokens), each
its own Encode; on CUDA every reply is a CUDA IPC ref released at once (each client's last one after
its embedding is written). The tower figures time `encode_prepared` on prepared images (device-side
preprocessing included, file decoding excluded); HF's tower gets its processor's pixel rows, processor
excluded. Make the checkpoints with `mmserve make-model --preset qwen2.5-vl-7b --weights vision`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import io
import time

import grpc
import numpy as np
import torch
from PIL import Image

from bench.encode_tput import MAX_MESSAGE, _wait_for_gpu, encoder_stats, steady_rate
from bench.gpu_clocks import GpuClocks
from bench.report import print_table, save_result
from bench.services import encoder_service, workdir
from bench.stats import ratio, summarize
from common.checkpoint import load_config, parse_dtype
from common.client import new_lease_owner
from common.image_geometry import PixelRange
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.vision.encoders import make_vision_encoder
from encoder_svc.stages import STAGES, TOWER_THREAD_PHASES

MIXED_SIZES = ((224, 224), (448, 336), (640, 480), (800, 800), (1024, 768), (1280, 720))


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the vision-path benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.vision_path", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen2.5-VL or Qwen3-VL checkpoint (vision weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--max-blocks", type=int, default=1280, help="max_pixels in merge blocks")
    p.add_argument("--images", type=int, default=256, help="distinct images per gRPC level")
    p.add_argument("--clients", default="1,64", help="comma-separated gRPC client counts")
    p.add_argument("--batches", default="1,8", help="tower batch sizes")
    p.add_argument("--rounds", type=int, default=5, help="timed tower rounds per figure")
    p.add_argument("--videos", type=int, default=4, help="distinct clips for the video level (0: none)")
    p.add_argument("--video-seconds", type=float, default=30.0)
    p.add_argument("--video-size", type=int, default=448)
    p.add_argument("--decode-threads-level", action="store_true",
                   help="also one client against an encoder decoding in its threads (--decode-processes 0)")
    p.add_argument("--vision-quantization", default="none", choices=("none", "fp8"),
                   help="fp8: also the FP8 tower in-process (figures, cosine to the full-precision one) and "
                   "an encoder service started with it (its 1- and many-client levels)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-service", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    return p


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def noise_images(n: int, size: tuple[int, int], seed: int) -> list[Image.Image]:
    """n distinct uniform-noise RGB images of size (width, height)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def pngs(images: list[Image.Image]) -> list[bytes]:
    """png() of every image, on threads (zlib drops the GIL)."""
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(png, images))


def timed(fn, device: torch.device, rounds: int) -> float:
    """Median seconds of fn() over `rounds` runs after two warm-ups (synchronised)."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# -- the tower in-process ----------------------------------------------------------------------------

def tower_figures(enc, images: list[Image.Image], pixels: PixelRange, batches: list[int],
                  rounds: int) -> dict:
    """images/s of encode_prepared at each batch size: the reference path (eager steps, SDPA per span
    length) and the fast path (Triton steps, varlen FlashAttention), and the device-side preprocessing
    alone. Restores the encoder's own choice afterwards."""
    device = enc.device
    prepared = [enc.prepare(im, pixels) for im in images]
    out: dict = {"grid": list(prepared[0].grid), "tokens": enc.layout.num_tokens(prepared[0].grid),
                 "fused_ops_default": bool(enc.fused_ops)}
    paths = {"reference": (enc.eager_ops, False, False)}
    if device.type == "cuda":
        paths["fast"] = (enc.eager_ops.fused(), True, False)
        if enc.capture_graphs(max(batches)):
            paths["fast_graphs"] = (enc.eager_ops.fused(), True, True)  # replayed after two eager runs
    for name, (ops, flash, graphs) in paths.items():
        enc.tower.use_ops(ops)
        enc.tower.flash_attention = flash
        for b in batches:
            chunk = prepared[:b]
            secs = timed(lambda chunk=chunk, graphs=graphs: enc.encode_prepared(chunk, use_graphs=graphs),
                         device, rounds)
            out[f"{name}_b{b}_images_per_s"] = b / secs
            out[f"{name}_b{b}_ms"] = 1000 * secs
            print(f"  tower {name} batch {b}: {b / secs:.1f} images/s ({1000 * secs:.1f} ms)", flush=True)
    if "_rows" in dir(enc):
        secs = timed(lambda: [enc._rows(p) for p in prepared[:1]], device, rounds)
        out["preprocess_ms"] = 1000 * secs
    enc.tower.use_ops(enc.eager_ops.fused() if enc.fused_ops else enc.eager_ops)
    enc.tower.flash_attention = True
    if enc.graphs is not None:
        out["graph_replays"] = enc.graphs.replays
    return out


def quantized_figures(enc, images: list[Image.Image], pixels: PixelRange, batches: list[int],
                      rounds: int, scheme: str) -> dict:
    """The tower quantized (`enc.quantize(scheme)`, in place): images/s with graphs at each batch size and
    each image's cosine to the full-precision tower's embedding (min and mean)."""
    prepared = [enc.prepare(im, pixels) for im in images]
    want = [e.float() for e in enc.encode_prepared(prepared)]
    graphs = enc.graphs
    enc.graphs = None  # graphs of the full-precision layers must not replay the quantized tower
    out: dict = {"layers": len(enc.quantize(scheme))}
    graphed = enc.capture_graphs(max(batches))
    got = enc.encode_prepared(prepared)
    cosines = [torch.nn.functional.cosine_similarity(g.float().flatten(), w.flatten(), dim=0).item()
               for g, w in zip(got, want, strict=True)]
    out.update(cosine_min=min(cosines), cosine_mean=float(np.mean(cosines)), graphs=graphed)
    print(f"  {scheme} tower: {out['layers']} layers; cosine to full precision min {out['cosine_min']:.5f} "
          f"mean {out['cosine_mean']:.5f}", flush=True)
    for b in batches:
        chunk = prepared[:b]
        secs = timed(lambda chunk=chunk: enc.encode_prepared(chunk, use_graphs=graphed), enc.device, rounds)
        out[f"b{b}_images_per_s"] = b / secs
        print(f"  tower {scheme}{' graphs' if graphed else ''} batch {b}: {b / secs:.1f} images/s "
              f"({1000 * secs:.1f} ms)", flush=True)
    del graphs
    return out


def profile_forward(enc, images: list[Image.Image], pixels: PixelRange, n: int = 15) -> dict:
    """The top device kernels of one fast batch-1 forward (torch.profiler), and device time over wall."""
    from torch.profiler import ProfilerActivity, profile

    prepared = [enc.prepare(images[0], pixels)]
    enc.encode_prepared(prepared)
    sync(enc.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if enc.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        enc.encode_prepared(prepared)
        sync(enc.device)
        wall = time.perf_counter() - t0
    rows, device_us = [], 0.0
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if us > 0:
            device_us += us
            rows.append([ev.key[:70], ev.count, round(us / 1000, 3)])
    rows.sort(key=lambda r: -r[2])
    return {"wall_ms": 1000 * wall, "device_ms": device_us / 1000, "top": rows[:n]}


def hf_tower(model_dir: str, device: torch.device, dtype: torch.dtype):
    """HF's vision tower alone (sdpa attention) with the checkpoint's weights, and its processor."""
    from transformers import AutoConfig

    from common.checkpoint import load_tensors
    from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor

    config = AutoConfig.from_pretrained(model_dir)
    prefixes = ("model.visual.", "visual.")
    state = {}
    for name, tensor in load_tensors(model_dir, prefixes).items():
        prefix = next(p for p in prefixes if name.startswith(p))
        state[name[len(prefix):]] = tensor
    tower = hf_tower_from_state(config.vision_config, state, device, dtype)
    return tower, load_qwen_image_processor(model_dir)


def hf_tower_from_state(vision_config, state: dict, device: torch.device, dtype: torch.dtype):
    """HF's vision tower (sdpa attention) of a Qwen2.5-VL or Qwen3-VL vision config, with `state` (HF's
    parameter names, as ours), in eval mode on `device`."""
    vision_config._attn_implementation = "sdpa"
    if vision_config.model_type.startswith("qwen3_vl"):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    tower = Tower._from_config(vision_config, dtype=dtype)
    tower.load_state_dict(state, strict=False)
    return tower.to(device).eval()


def hf_figures(model_dir: str, device: torch.device, dtype: torch.dtype, images: list[Image.Image],
               pixels: PixelRange, batches: list[int], rounds: int) -> dict:
    """images/s of HF's tower at each batch size on its processor's pixel rows (processor excluded)."""
    tower, processor = hf_tower(model_dir, device, dtype)
    size = {"shortest_edge": pixels.min_pixels, "longest_edge": pixels.max_pixels}
    out = {}
    for b in batches:
        batch = processor(images=images[:b], return_tensors="pt", size=size)
        pv = batch["pixel_values"].to(device, dtype)
        grid = batch["image_grid_thw"].to(device)

        def run(pv=pv, grid=grid, tower=tower):
            with torch.inference_mode():
                tower(pv, grid_thw=grid)

        secs = timed(run, device, rounds)
        out[f"b{b}_images_per_s"] = b / secs
        print(f"  HF tower batch {b}: {b / secs:.1f} images/s", flush=True)
    del tower
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def host_costs(images: list[Image.Image]) -> dict:
    """ms per image of the encoder's host work on one core: the PNG decode + hash the decode stage runs
    (decode_and_hash, in this process: no pool), and PIL's decode alone."""
    from common.images import ImageLimits
    from encoder_svc.decoded_image import decode_and_hash

    files = pngs(images)

    def per_image(fn) -> float:
        fn(files[0])
        t0 = time.perf_counter()
        for data in files:
            fn(data)
        return 1000 * (time.perf_counter() - t0) / len(files)

    out = {"png_bytes": len(files[0]),
           "decode_and_hash_ms": per_image(lambda d: decode_and_hash(d, ImageLimits(), "fp", "")),
           "pil_decode_ms": per_image(lambda d: Image.open(io.BytesIO(d)).load())}
    print(f"  host, per image: decode + hash {out['decode_and_hash_ms']:.1f} ms (PIL decode "
          f"{out['pil_decode_ms']:.1f} ms, {out['png_bytes']} bytes)", flush=True)
    return out


# -- the encoder service -----------------------------------------------------------------------------

async def encode_level(address: str, items: list[common_pb2.ImageInput | common_pb2.VideoInput],
                       concurrency: int, cuda: bool) -> dict:
    """Each item as its own Encode from `concurrency` clients; leases released at once (each client's
    last after its embedding is written, on CUDA)."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(4)]
    stubs = [encoder_pb2_grpc.EncoderServiceStub(c) for c in channels]
    owner = new_lease_owner()
    accept = [common_pb2.TRANSPORT_CUDA_IPC if cuda else common_pb2.TRANSPORT_INLINE]
    queue = list(reversed(items))
    latencies, finished, last = [], [], []

    async def release(stub, refs) -> None:
        ids = [r.lease_id for r in refs if r.lease_id]
        if ids:
            await stub.Release(encoder_pb2.ReleaseRequest(lease_ids=ids, lease_owner=owner), timeout=30)

    async def client(i: int) -> None:
        stub = stubs[i % len(stubs)]
        while queue:
            item = queue.pop()
            request = encoder_pb2.EncodeRequest(accept=accept, lease_owner=owner)
            (request.videos if isinstance(item, common_pb2.VideoInput) else request.images).append(item)
            t0 = time.perf_counter()
            reply = await stub.Encode(request, timeout=300)
            finished.append(time.perf_counter())
            latencies.append(finished[-1] - t0)
            if cuda and not queue:
                last.extend(reply.embeddings)
            else:
                await release(stub, reply.embeddings)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    if last:
        await asyncio.to_thread(_wait_for_gpu, last)
    wall = time.perf_counter() - t0
    await release(stubs[0], last)
    for c in channels:
        await c.close()
    return {"clients": concurrency, "items": len(items), "wall_s": wall, "items_per_s": len(items) / wall,
            "steady_items_per_s": steady_rate(finished), "latency": summarize(latencies)}


def stage_split(before: dict, after: dict) -> dict:
    """Mean ms per Encode of each stage between two GetStats snapshots."""
    sec0, sec1 = before.get("stage_seconds", {}), after.get("stage_seconds", {})
    n = int(after.get("encode_calls", 0)) - int(before.get("encode_calls", 0))
    return {stage: 1000 * (float(sec1[stage]) - float(sec0.get(stage, 0.0))) / max(n, 1) for stage in sec1}


def tower_thread_split(before: dict, after: dict, wall_s: float) -> dict:
    """Between two GetStats snapshots: the tower thread's seconds per phase as fractions of the wall time,
    the mean batch, and the GPU's busy fraction (tower_gpu_seconds over the wall time; 0 on a CPU)."""
    sec0, sec1 = before.get("tower_thread_seconds", {}), after.get("tower_thread_seconds", {})
    batches = int(after.get("vision_batches", 0)) - int(before.get("vision_batches", 0))
    images = int(after.get("encodes", 0)) - int(before.get("encodes", 0))
    out = {phase: (float(sec1[phase]) - float(sec0.get(phase, 0.0))) / wall_s for phase in sec1}
    # the thread's idle time is booked when a batch starts, so the wait before the level's first batch
    # would count: idle is the rest of the wall time here
    out["idle"] = max(0.0, 1.0 - sum(v for k, v in out.items() if k != "idle"))
    gpu = float(after.get("tower_gpu_seconds", 0.0)) - float(before.get("tower_gpu_seconds", 0.0))
    out.update(batches=batches, mean_batch=images / max(batches, 1), gpu_busy=gpu / wall_s)
    return out


def _clock_text(clocks: dict) -> str:
    if not clocks:
        return ""
    return (f"; SM clock median {clocks['sm_mhz_median']:.0f} MHz (min {clocks['sm_mhz_min']:.0f}), "
            f"{clocks['power_w_median']:.0f} W")


def service_level(address: str, name: str, items: list, clients: int, tokens: int, cuda: bool) -> dict:
    """One gRPC level (encode_level) with its tokens/s, the encoder's stage split and its tower thread's
    split over it; printed."""
    before = encoder_stats(address)
    with GpuClocks() as clocks:
        result = asyncio.run(encode_level(address, items, clients, cuda))
    after = encoder_stats(address)
    result["gpu_clocks"] = clocks.summary()
    result.update(name=name, tokens_per_s=tokens / result["wall_s"], stages_ms=stage_split(before, after),
                  tower_thread=tower_thread_split(before, after, result["wall_s"]))
    stages = " ".join(f"{k} {result['stages_ms'].get(k, 0.0):.1f}" for k in STAGES)
    thread = result["tower_thread"]
    phases = " ".join(f"{k} {thread.get(k, 0.0):.2f}" for k in TOWER_THREAD_PHASES)
    print(f"  {name} c={clients}: {result['items_per_s']:.1f}/s, p50 {result['latency']['p50_ms']:.1f} ms, "
          f"{result['tokens_per_s']:.0f} tokens/s; stages ms/Encode: {stages}; tower thread (share of wall): "
          f"{phases}; {thread['batches']} batches of {thread['mean_batch']:.1f}; GPU busy "
          f"{thread['gpu_busy']:.2f}{_clock_text(result['gpu_clocks'])}", flush=True)
    return result


def service_figures(args: argparse.Namespace, enc_tokens, pixels: PixelRange) -> dict:
    """The encoder service through gRPC: each client count on fresh images, a mixed-size stream, videos;
    each level with its stage split. With --decode-threads-level, one client again against an encoder
    that decodes in its threads."""
    cuda = args.device == "cuda"
    logs = workdir(args.logs)
    extra = ["--cache-bytes", str(4 << 30 if cuda else 512 << 20)]
    side = (args.image_size, args.image_size)
    tokens_each = enc_tokens(side)
    most = max(int(c) for c in args.clients.split(","))

    def image_inputs(images: list[Image.Image]) -> list[common_pb2.ImageInput]:
        lo, hi = pixels.min_pixels, pixels.max_pixels
        return [common_pb2.ImageInput(data=data, min_pixels=lo, max_pixels=hi) for data in pngs(images)]

    out: dict = {"levels": []}
    if args.vision_quantization != "none":  # the quantized encoder first: same-size levels only
        quantized = encoder_service(args.model, logs, args.device, args.dtype,
                                    [*extra, "--vision-quantization", args.vision_quantization],
                                    name=f"encoder-{args.vision_quantization}").start(600)
        try:
            asyncio.run(encode_level(quantized.address, image_inputs(noise_images(16, side, 997)), 8, cuda))
            for seed, clients in enumerate(int(c) for c in args.clients.split(",")):
                images = noise_images(args.images if clients > 1 else min(args.images, 32), side, 200 + seed)
                name = f"same-size, {args.vision_quantization}"
                out["levels"].append(service_level(quantized.address, name, image_inputs(images), clients,
                                                   tokens_each * len(images), cuda))
        finally:
            quantized.stop()
    service = encoder_service(args.model, logs, args.device, args.dtype, extra).start(600)
    try:
        address = service.address
        asyncio.run(encode_level(address, image_inputs(noise_images(16, side, 999)), 8,
                                 cuda))  # warm-up: connections, kernels, allocator
        for seed, clients in enumerate(int(c) for c in args.clients.split(",")):
            images = noise_images(args.images if clients > 1 else min(args.images, 32), side, 100 + seed)
            out["levels"].append(service_level(address, "same-size", image_inputs(images), clients,
                                               tokens_each * len(images), cuda))
        rng = np.random.default_rng(7)
        sizes = [MIXED_SIZES[i] for i in rng.integers(0, len(MIXED_SIZES), args.images)]
        mixed = [noise_images(1, s, 500 + i)[0] for i, s in enumerate(sizes)]
        out["levels"].append(service_level(address, "mixed-sizes", image_inputs(mixed), most,
                                           sum(enc_tokens(s) for s in sizes), cuda))
        if args.videos:
            from bench.video_serve import make_clip, pick_codec

            codec = pick_codec()
            clips = [make_clip(args.video_seconds, 30, args.video_size, 900 + i, codec)
                     for i in range(args.videos)]
            videos = [common_pb2.VideoInput(data=c) for c in clips]
            result = service_level(address, "video", videos, 1, 0, cuda)
            frames = 2 * args.video_seconds * len(clips)  # at the model's 2 fps
            result["frames_per_s"] = frames / result["wall_s"]
            print(f"  video: {result['frames_per_s']:.1f} frames/s", flush=True)
            out["levels"].append(result)
        out["final_stats"] = encoder_stats(address)
    finally:
        service.stop()
    if args.decode_threads_level:
        threads = encoder_service(args.model, logs, args.device, args.dtype,
                                  [*extra, "--decode-processes", "0"], name="encoder-threads").start(600)
        try:
            asyncio.run(encode_level(threads.address, image_inputs(noise_images(8, side, 998)), 1, cuda))
            images = noise_images(min(args.images, 32), side, 300)
            out["levels"].append(service_level(threads.address, "same-size, decode in threads",
                                               image_inputs(images), 1, tokens_each * len(images), cuda))
        finally:
            threads.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    config = load_config(args.model)
    enc = make_vision_encoder(args.model, device, dtype)
    block = enc.layout.patch_size * enc.layout.merge_size
    pixels = PixelRange(enc.layout.min_pixels, min(enc.layout.max_pixels, args.max_blocks * block * block))
    batches = [int(b) for b in args.batches.split(",")]
    side = (args.image_size, args.image_size)
    images = noise_images(max(batches), side, 0)
    fused = enc.fused_ops
    print(f"== {config.get('model_type')} on {device} {args.dtype}: fused ops {fused}", flush=True)
    result: dict = {"model_type": config.get("model_type"), "max_pixels": pixels.max_pixels}
    result["tower"] = tower_figures(enc, images, pixels, batches, args.rounds)
    result["profile"] = profile_forward(enc, images, pixels)
    from common.vision.attention import _DENSE_FASTER

    result["attention_dense_cudnn"] = {str(key[:4]): dense for key, dense in _DENSE_FASTER.items()}
    print(f"  attention: dense cuDNN chosen per (spans, length, heads, head_dim): "
          f"{result['attention_dense_cudnn']}", flush=True)
    result["host"] = host_costs(images[:4])
    print_table("fast forward, batch 1: top device kernels", ["kernel", "calls", "ms"],
                result["profile"]["top"])
    print(f"  wall {result['profile']['wall_ms']:.1f} ms, device {result['profile']['device_ms']:.1f} ms",
          flush=True)

    if args.vision_quantization != "none":
        result["quantized"] = quantized_figures(enc, images, pixels, batches, args.rounds,
                                                args.vision_quantization)
    layout = enc.layout

    def tokens_of(size: tuple[int, int]) -> int:
        return layout.num_tokens(layout.grid(size[1], size[0], pixels))

    del enc
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf:
        result["hf"] = hf_figures(args.model, device, dtype, images, pixels, batches, args.rounds)
        for b in batches:
            tower = result["tower"]
            fast = tower.get(f"fast_b{b}_images_per_s", tower[f"reference_b{b}_images_per_s"])
            result[f"ours_over_hf_b{b}"] = ratio(fast, result["hf"][f"b{b}_images_per_s"])
    if not args.no_service:
        result["service"] = service_figures(args, tokens_of, pixels)
    save_result(f"vision_path_{config.get('model_type')}", args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
