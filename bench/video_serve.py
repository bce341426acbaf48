"""Qwen2.5-VL or Qwen3-VL videos through the services: cold and warm TTFT of one clip, and lookahead on/off.

    python -m bench.video_serve --model DIR [--device cuda --dtype bfloat16] [--hf] [--out video.json]

Everything goes through the public gRPC contract: `GenerateRequest.videos` (VideoInput bytes, the
model's default sampling: 2 fps) with `<|vision_start|><|video_pad|><|vision_end|>` in a prompt. The
family follows the checkpoint (bench.qwen_gpu.family_of): results saved as benchmark `qwen_video` with
headline rows "qwen video ..." for Qwen2.5-VL, `qwen3_video` and "qwen3 video ..." for Qwen3-VL.

- Clips: --clips distinct mp4s of --clip-seconds at --clip-fps, --clip-size square (a textured pattern
  moving differently in each clip), encoded once with PyAV (libx264 when it can, else mpeg4); the
  first clip's sampled frames, grid and tokens, and its host decode + patch time, are reported.
- TTFT cold / warm through one decoder: --ttft-rounds clips, each under a fresh cache salt (an encoder
  miss and no prefix KV), then the same request again (an encoder-cache hit and a prefix hit); medians.
  With --hf, HF's model (in this process, after the services stop) on the same clips: vision tower +
  prefill + one token (generate(max_new_tokens=1)) on pixel_values_videos made by common/video's
  `video_patches`, as tests/video's VideoOracle builds them, and the host time of that decode + patches.
- Lookahead: two decoders on the one encoder (--encoder-max-ahead --max-ahead vs 0, the same
  --max-num-seqs), --requests video requests sent one every --arrival-interval s while earlier ones
  decode --output-len tokens; each request has its own cache salt (clips are reused across requests,
  but every request misses the encoder cache and the prefix cache). Mean and p50/p90 TTFT each, the
  ratio on/off (issue 28's goal: <= 0.75), and each decoder's lookahead counters.

A part that fails is recorded under its key as {"error": ...}; the JSON is written whatever happens
(also on SIGTERM from `timeout`), with the headline rows of the parts that finished (None otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time
import traceback
import uuid

import grpc
import numpy as np

from bench import svcstats
from bench.qwen_gpu import END, USER, family_of
from bench.report import save_result
from bench.services import Service, decoder_service, encoder_service, exit_on_sigterm, start_all, workdir
from common.client import AsyncDecoderClient, DecoderClient, generate_request
from common.pb import decoder_pb2

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
DECODER_STATS = ("images_encoded", "images_encoder_cache_hits", "images_skipped_by_kv_reuse",
                 "images_prefetched", "lookahead_ready_at_prefill", "lookahead_waited_at_prefill",
                 "lookahead_boosted", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                 "preemptions", "requests_finished", "requests_failed")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the video benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.video_serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clips", type=int, default=8, help="distinct clips made (reused with other salts)")
    p.add_argument("--clip-seconds", type=float, default=30.0)
    p.add_argument("--clip-fps", type=int, default=30)
    p.add_argument("--clip-size", type=int, default=448, help="square frames of this many pixels a side")
    p.add_argument("--codec", default="auto", choices=("auto", "libx264", "mpeg4"),
                   help="auto: libx264 when PyAV has it, else mpeg4")
    p.add_argument("--ttft-rounds", type=int, default=3, help="cold/warm pairs (medians)")
    p.add_argument("--requests", type=int, default=16, help="requests of the lookahead run")
    p.add_argument("--arrival-interval", type=float, default=0.5, help="seconds between lookahead requests")
    p.add_argument("--output-len", type=int, default=32, help="tokens per lookahead request")
    p.add_argument("--max-num-seqs", type=int, default=2, help="running requests per decoder")
    p.add_argument("--max-ahead", type=int, default=4, help="--encoder-max-ahead of the 'on' decoder")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30, help="per decoder, on CUDA")
    p.add_argument("--encoder-cache-bytes", type=int, default=8 << 30, help="the encoder's arena, on CUDA")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--hf", action="store_true", help="also HF's vision + prefill on the same clips")
    p.add_argument("--no-lookahead", action="store_true", help="only the cold/warm part (one decoder)")
    p.add_argument("--no-ttft", action="store_true", help="only the lookahead part")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


# --- clips -----------------------------------------------------------------------------------------

def pick_codec(requested: str = "auto") -> str:
    """libx264 if asked for (or auto) and PyAV can open it, else mpeg4."""
    import av

    if requested == "mpeg4":
        return "mpeg4"
    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:  # noqa: BLE001 - missing or unusable encoder in this FFmpeg build
        if requested == "libx264":
            raise
        return "mpeg4"


def make_clip(seconds: float, fps: int, size: int, seed: int, codec: str = "mpeg4") -> bytes:
    """An mp4 of round(seconds * fps) size x size frames: a blocky random texture (its own per seed)
    drifting by a seed-dependent step each frame, with a colour shift over time. Every frame differs, yet
    it compresses like real footage (motion), far below the encoder's byte cap."""
    import av

    if size % 2:
        raise ValueError(f"--clip-size must be even (yuv420p), not {size}")
    rng = np.random.default_rng(seed)
    block = max(2, size // 28)
    cells = -(-size // block)
    base = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
    texture = np.kron(base, np.ones((block, block, 1), np.uint8))[:size, :size]
    dy, dx = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    n = max(1, round(seconds * fps))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"} if codec == "libx264" else {"qscale": "4"}
        for i in range(n):
            frame = np.roll(texture, (i * dy, i * dx), axis=(0, 1))
            frame = np.ascontiguousarray(np.clip(frame.astype(np.int16) + (i * 3) % 64, 0, 255), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def make_clips(args: argparse.Namespace) -> tuple[list[bytes], dict]:
    """args.clips distinct clips and a description of them (codec, bytes, seconds taken)."""
    codec = pick_codec(args.codec)
    t0 = time.perf_counter()

    def make_all(codec: str) -> list[bytes]:
        return [make_clip(args.clip_seconds, args.clip_fps, args.clip_size, seed=1000 + i, codec=codec)
                for i in range(max(1, args.clips))]

    try:
        clips = make_all(codec)
    except Exception:  # noqa: BLE001 - e.g. a libx264 that opens but cannot encode here
        if args.codec != "auto" or codec == "mpeg4":
            raise
        traceback.print_exc()
        codec = "mpeg4"
        clips = make_all(codec)
    made_s = time.perf_counter() - t0
    sizes = [len(c) for c in clips]
    return clips, {"codec": codec, "count": len(clips), "seconds": args.clip_seconds, "fps": args.clip_fps,
                   "size": args.clip_size, "mean_bytes": round(statistics.fmean(sizes)),
                   "max_bytes": max(sizes), "make_s": round(made_s, 2)}


def video_config(model_dir: str):
    """The checkpoint's video config (its family's rules) with default request settings (what the services
    resolve)."""
    from common.checkpoint import load_config
    from common.families import layout_family
    from common.video import VideoLimits, video_request_config

    config = load_config(model_dir)
    rules = layout_family(config).image_layout(model_dir, config).video_config(model_dir)
    return video_request_config(rules, limits=VideoLimits())


def host_prep(clip: bytes, config) -> dict:
    """The clip decoded and turned into patch rows on the host, as HF is given it; timings in ms."""
    import torch

    from common.families.qwen2_5_vl.video_timing import video_timing
    from common.video import VideoLimits, decode_video, video_patches

    t0 = time.perf_counter()
    decoded = decode_video(clip, config.sampling.indices_for, VideoLimits())
    t1 = time.perf_counter()
    rows, grid = video_patches(decoded.frames, config)
    t2 = time.perf_counter()
    info = decoded.info
    timing = video_timing(decoded.indices, info.total_frames, info.fps, config.geometry.temporal_patch_size)
    return {"decoded": decoded, "rows": torch.as_tensor(rows), "grid": tuple(int(g) for g in grid),
            "timing": timing, "decode_ms": (t1 - t0) * 1000, "patches_ms": (t2 - t1) * 1000}


def describe_clip(clip: bytes, config) -> dict:
    """Sampled frames, grid, tokens and host decode + patch time of one clip, and its decode time at
    several --video-decode-threads (the fastest of 3 each; the services use the default)."""
    from common.video import VideoLimits, decode_video
    from common.video.limits import available_cores, default_decode_threads

    prep = host_prep(clip, config)
    grid = prep["grid"]
    by_threads = {}
    for threads in sorted({1, 2, 4, 8, available_cores()}):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            decode_video(clip, config.sampling.indices_for, VideoLimits(decode_threads=threads))
            times.append(time.perf_counter() - t0)
        by_threads[threads] = round(min(times) * 1000, 1)
    return {"sampled_frames": len(prep["decoded"].indices), "grid_thw": list(grid),
            "tokens": config.geometry.num_tokens(grid), "patch_rows": int(prep["rows"].shape[0]),
            "host_decode_ms": round(prep["decode_ms"], 1), "host_patches_ms": round(prep["patches_ms"], 1),
            "default_decode_threads": default_decode_threads(), "host_decode_ms_by_threads": by_threads}


# --- requests --------------------------------------------------------------------------------------

def video_request(prompt: str, clip: bytes, salt: str, n: int) -> decoder_pb2.GenerateRequest:
    """A greedy request of exactly n tokens with one video (the model's default sampling)."""
    request = generate_request(prompt, max_tokens=n, ignore_eos=True, cache_salt=salt)
    request.videos.add(data=clip)
    return request


async def _one(client: AsyncDecoderClient, request: decoder_pb2.GenerateRequest, timeout: float,
               delay: float = 0.0) -> dict:
    """{"ttft": seconds to the first token, "e2e", "prompt_tokens", "cached_prompt_tokens"}, sent after
    `delay` seconds."""
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    first, usage = None, None
    try:
        async for chunk in client.stub.Generate(request, timeout=timeout):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            if chunk.HasField("usage"):
                usage = chunk.usage
    except grpc.RpcError as exc:  # counted as missing; the run goes on
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return {"ttft": float("nan"), "e2e": float("nan"), "error": f"{code}: {details}"[:500]}
    out = {"ttft": first if first is not None else float("nan"), "e2e": time.perf_counter() - t0}
    if usage is not None:
        out["prompt_tokens"] = usage.prompt_tokens
        out["cached_prompt_tokens"] = usage.cached_prompt_tokens
    return out


async def _run(address: str, requests: list[decoder_pb2.GenerateRequest], timeout: float,
               interval: float = 0.0) -> list[dict]:
    """Request i sent at i * interval on one channel; their results in order."""
    async with AsyncDecoderClient(address, timeout=timeout) as client:
        return list(await asyncio.gather(*(_one(client, r, timeout, i * interval)
                                           for i, r in enumerate(requests))))


def summary(values: list[float]) -> dict:
    """n, mean, p50, p90 in ms (NaN values, i.e. no token, are left out and counted)."""
    good = sorted(v * 1000 for v in values if v == v)
    if not good:
        return {"n": 0, "missing": len(values)}
    return {"n": len(good), "missing": len(values) - len(good), "mean_ms": round(statistics.fmean(good), 1),
            "p50_ms": round(good[len(good) // 2], 1), "p90_ms": round(good[int(len(good) * 0.9)], 1)}


def prompt_of(i: int) -> str:
    return USER + VIDEO + f"request {i}: describe what happens in this video" + END


def ttft_cold_warm(address: str, encoder: str, clips: list[bytes], rounds: int, timeout: float,
                   out: dict) -> None:
    """Cold then warm TTFT of rounds requests, one at a time on one decoder; medians in ms, into out
    (each round's figures as they come: a run cut short keeps them). Each cold round also has the
    encoder's Encode split (stages.py: decode, queue, preprocess = the video lane's frame decoding and
    patching, tower, handoff) and its tower's device time."""
    cold, warm = [], []
    rows = out["rounds"] = []
    before = decoder_stats(address)
    for r in range(rounds):
        request = video_request(prompt_of(r), clips[r % len(clips)], f"cold-{uuid.uuid4().hex[:12]}", 1)
        s0, e0 = svcstats.decoder_stats(address), svcstats.encoder_stats(encoder)
        a = asyncio.run(_run(address, [request], timeout))[0]
        s1, e1 = svcstats.decoder_stats(address), svcstats.encoder_stats(encoder)
        b = asyncio.run(_run(address, [request], timeout))[0]
        s2 = svcstats.decoder_stats(address)
        for res in (a, b):
            if "error" in res:
                raise RuntimeError(f"a request failed: {res['error']}")
        cold.append(a["ttft"])
        warm.append(b["ttft"])
        rows.append({"cold_ms": round(a["ttft"] * 1000, 1), "warm_ms": round(b["ttft"] * 1000, 1),
                     "prompt_tokens": a.get("prompt_tokens"),
                     "warm_cached_prompt_tokens": b.get("cached_prompt_tokens"),
                     "cold_split_ms": svcstats.stage_split(s0, s1),
                     "cold_encoder_split_ms": svcstats.stage_split(e0, e1, "stage_seconds", "encode_calls"),
                     "cold_tower_gpu_ms": round(1e3 * (e1["tower_gpu_seconds"] - e0["tower_gpu_seconds"]), 2),
                     "warm_split_ms": svcstats.stage_split(s1, s2)})
        print(f"ttft round {r}: {rows[-1]}", flush=True)
    after = decoder_stats(address)
    out["stats"] = {k: after[k] - before[k] for k in DECODER_STATS}
    out.update(cold_ms=round(statistics.median(cold) * 1000, 1),
               warm_ms=round(statistics.median(warm) * 1000, 1))


def decoder_stats(address: str) -> dict:
    with DecoderClient(address, timeout=30) as client:
        stats = client.stats()
    return {f: getattr(stats, f) for f in DECODER_STATS}


def lookahead_run(addresses: dict[str, str], clips: list[bytes], args: argparse.Namespace, out: dict) -> None:
    """The same arrival schedule to the decoder with lookahead and the one without; TTFT each, into out."""
    out.update(requests=args.requests, arrival_interval_s=args.arrival_interval, output_len=args.output_len,
               max_num_seqs=args.max_num_seqs, max_ahead=args.max_ahead)
    for name in ("on", "off"):
        before = decoder_stats(addresses[name])
        run = uuid.uuid4().hex[:12]
        requests = [video_request(prompt_of(i), clips[i % len(clips)], f"la-{name}-{run}-{i}",
                                  args.output_len) for i in range(args.requests)]
        t0 = time.perf_counter()
        res = asyncio.run(_run(addresses[name], requests, args.request_timeout, args.arrival_interval))
        wall = time.perf_counter() - t0
        after = decoder_stats(addresses[name])
        out[name] = {**summary([r["ttft"] for r in res]), "e2e": summary([r["e2e"] for r in res]),
                     "wall_s": round(wall, 2), "stats": {k: after[k] - before[k] for k in DECODER_STATS}}
        errors = [r["error"] for r in res if "error" in r]
        if errors:
            out[name]["errors"] = errors[:4]
        print(f"lookahead {name}: {out[name]}", flush=True)
    on, off = out["on"].get("mean_ms"), out["off"].get("mean_ms")
    out["mean_on_over_off"] = round(on / off, 3) if on and off else None


# --- HF reference ----------------------------------------------------------------------------------

def hf_reference(args: argparse.Namespace, clips: list[bytes], config, out: dict) -> None:
    """HF's vision tower + prefill + one token on the clips (first round a warm-up), medians in ms."""
    import torch
    from transformers import AutoTokenizer

    from bench.qwen_gpu import load_hf
    from common.checkpoint import parse_dtype
    from common.families.qwen2_5_vl.video_timing import qwen3_vl_timestamp_text

    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    t0 = time.perf_counter()
    hf = load_hf(args.model, device, dtype)
    load_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    qwen3 = config.geometry.family == "qwen3_vl"
    merge = config.geometry.merge_size

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, preps, tokens = [], [], []
    rounds = max(1, args.ttft_rounds)
    for r in range(rounds + 1):  # round 0 warms HF up (kernels, allocator)
        clip = clips[r % len(clips)]
        prep = host_prep(clip, config)
        t, h, w = prep["grid"]
        per_group = h * w // (merge * merge)
        if qwen3:  # Qwen3VLProcessor.replace_video_token: one timestamped run per temporal group
            text = "".join(qwen3_vl_timestamp_text(s) + "<|vision_start|>" + "<|video_pad|>" * per_group
                           + "<|vision_end|>" for s in prep["timing"].timestamps)
        else:
            text = "<|video_pad|>" * (t * per_group)
        enc = tokenizer(prompt_of(r).replace("<|video_pad|>", text), return_tensors="pt")
        ids = enc["input_ids"]
        cfg = hf.config
        kwargs = {"input_ids": ids.to(device), "attention_mask": enc["attention_mask"].to(device),
                  "mm_token_type_ids": (2 * (ids == cfg.video_token_id).int()).to(device),
                  "pixel_values_videos": prep["rows"].to(device, dtype),
                  "video_grid_thw": torch.tensor([list(prep["grid"])], device=device)}
        if not qwen3:
            kwargs["second_per_grid_ts"] = torch.tensor([prep["timing"].second_per_grid], device=device)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(**kwargs, max_new_tokens=1, do_sample=False)
        sync()
        if r:
            times.append(time.perf_counter() - t0)
            preps.append(prep["decode_ms"] + prep["patches_ms"])
            tokens.append(int(ids.shape[1]))
        print(f"hf round {r}: {(time.perf_counter() - t0) * 1000:.1f} ms, {ids.shape[1]} prompt tokens",
              flush=True)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(vision_prefill_ms=round(statistics.median(times) * 1000, 1),
               host_prep_ms=round(statistics.median(preps), 1), load_s=round(load_s, 1), rounds=rounds,
               prompt_tokens=tokens)


# --- main ------------------------------------------------------------------------------------------

def stop_all(services: list[Service]) -> None:
    """SIGTERM every service first, then wait for each: the whole stop stays short under `timeout`."""
    for svc in services:
        try:
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.terminate()
        except OSError:
            pass
    for svc in services:
        svc.stop(timeout=20)


def _part(result: dict, key: str, fn) -> None:
    """fn(result[key]) filling a new dict, or its "error" when it raises (the other parts still run)."""
    out = result[key] = {}
    try:
        fn(out)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the run goes on
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]


def main(argv: list[str] | None = None) -> int:
    """Make the clips, spawn the services, run the parts; print and save the JSON (always)."""
    args = build_arg_parser().parse_args(argv)
    exit_on_sigterm()  # `timeout`'s SIGTERM becomes SystemExit: the JSON is saved, the services stopped
    label = family_of(args.model)[0]
    result: dict = {"model": args.model, "family": label, "device": args.device, "dtype": args.dtype}
    services = []
    try:
        clips, result["clips"] = make_clips(args)
        config = video_config(args.model)
        result["clips"].update(describe_clip(clips[0], config))
        print("clips", result["clips"], flush=True)
        logs = workdir(args.logs)
        cuda = args.device == "cuda"
        dec_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                    str(args.max_num_batched_tokens), "--encoder-timeout", str(int(args.request_timeout))]
        if cuda:
            dec_args += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
        enc = encoder_service(args.model, logs, args.device, args.dtype,
                              ["--cache-bytes", str(args.encoder_cache_bytes)] if cuda else [])
        on = decoder_service(args.model, enc.address, logs, args.device, args.dtype,
                             dec_args + ["--encoder-max-ahead", str(args.max_ahead)], name="decoder-on")
        off = decoder_service(args.model, enc.address, logs, args.device, args.dtype,
                              dec_args + ["--encoder-max-ahead", "0"], name="decoder-off")
        services = [enc, on] if args.no_lookahead else [enc, on, off]
        t0 = time.perf_counter()
        start_all(services)
        result["services_start_s"] = round(time.perf_counter() - t0, 1)
        print(f"services up in {result['services_start_s']} s (logs in {logs})", flush=True)
        for svc in services[1:]:  # first-request costs (kernels, graphs, channels) out of the figures:
            warm = video_request(prompt_of(0), clips[0], f"warmup-{uuid.uuid4().hex[:12]}", 2)
            for _ in range(2):  # a miss, then the encoder-cache and prefix hit path
                res = asyncio.run(_run(svc.address, [warm], args.request_timeout))[0]
                if "error" in res:
                    raise RuntimeError(f"{svc.name}: the warm-up video request failed: {res['error']}")
        if not args.no_ttft:
            _part(result, "ttft", lambda out: ttft_cold_warm(on.address, enc.address, clips,
                                                               max(1, args.ttft_rounds),
                                                               args.request_timeout, out))
        if not args.no_lookahead:
            _part(result, "lookahead",
                  lambda out: lookahead_run({"on": on.address, "off": off.address}, clips, args, out))
        stop_all(services)
        services = []
        if args.hf:
            _part(result, "hf", lambda out: hf_reference(args, clips, config, out))
    except Exception as exc:  # noqa: BLE001 - recorded; the JSON is still written
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        try:
            _finish(args, label, result)  # first: a second signal may not leave time for both
        finally:
            stop_all(services)
    failed = "error" in result or any("error" in _part_of(result, k) for k in ("ttft", "lookahead", "hf"))
    return 1 if failed else 0


def _part_of(result: dict, key: str) -> dict:
    part = result.get(key)
    return part if isinstance(part, dict) else {}


def _ok(result: dict, key: str) -> dict:
    part = _part_of(result, key)
    return {} if "error" in part else part


def _finish(args: argparse.Namespace, label: str, result: dict) -> None:
    """Add the headline (None for a part that did not finish), print and save."""
    clip, ttft, la, hf = (_ok(result, k) for k in ("clips", "ttft", "lookahead", "hf"))
    grid = "x".join(str(g) for g in clip.get("grid_thw", [])) or None
    result["headline"] = [
        [f"{label} video clip: {args.clip_seconds:g} s {args.clip_fps} fps {args.clip_size}px, "
         "sampled frames / grid / tokens",
         f"{clip.get('sampled_frames')} / {grid} / {clip.get('tokens')}" if clip else None],
        [f"{label} video TTFT cold / warm ms",
         f"{ttft['cold_ms']} / {ttft['warm_ms']}" if "warm_ms" in ttft else None],
        [f"{label} video HF vision+prefill ms / host decode+patches ms",
         f"{hf['vision_prefill_ms']} / {hf['host_prep_ms']}" if "vision_prefill_ms" in hf else None],
        [f"{label} video lookahead mean TTFT ms (on / off)",
         f"{la['on'].get('mean_ms')} / {la['off'].get('mean_ms')}" if "off" in la else None],
        [f"{label} video lookahead on/off mean TTFT", la.get("mean_on_over_off")],
    ]
    save_result(f"{label}_video", args, result, headline=result["headline"])
    print(result["headline"], flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
