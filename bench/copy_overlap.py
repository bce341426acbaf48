"""Do embedding uploads overlap the model's compute? A profiler trace of a decoding engine fed by SHM.

    python -m bench.copy_overlap --model DIR --device cuda --dtype bfloat16 [--trace trace.json] [--out X]

An encoder subprocess with a shared-memory arena; in this process, the decoder's engine with the remote
embedding source limited to SHM (and inline), so each image's rows travel host -> GPU. A batch of
text requests keeps the engine decoding; image requests arrive while it does, and torch.profiler
records the steps. From the trace: every host-to-device copy of embedding size, the stream it ran on,
and how much of its time a model kernel on the compute stream was running at once. Copies on their own
stream during compute kernels is what the serving-path issue asks for.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import encoder_service, exit_on_sigterm, workdir
from bench.workload import PromptMaker, random_png
from common.pb import common_pb2
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource
from decoder_svc.engine.engine import EngineConfig, LLMEngine
from decoder_svc.engine.sampling_params import SamplingParams

PROMPT = "USER: <image>\nDescribe the picture. ASSISTANT:"


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.copy_overlap", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--text-requests", type=int, default=16, help="requests that keep the engine decoding")
    p.add_argument("--images", type=int, default=12, help="image requests that arrive while it does")
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--trace", default=None, help="write the Chrome trace here")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: the profiler then records every compute kernel (inside a graph "
                   "replay it records only some), so the overlap is measured in full")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


def _intervals(events: list[dict], pred) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if pred(e))


def _overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    """Microseconds of span covered by the (sorted, possibly overlapping) busy intervals."""
    lo, hi = span
    covered, cursor = 0.0, lo
    for a, b in busy:
        if b <= cursor:
            continue
        if a >= hi:
            break
        a = max(a, cursor)
        b = min(b, hi)
        if b > a:
            covered += b - a
            cursor = b
    return covered


def analyze(trace: dict, min_bytes: int) -> dict:
    """Embedding-sized H2D copies: their streams, and the share of their time under compute kernels."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"error": "no kernels in the trace"}
    streams: dict[int, int] = {}
    for k in kernels:
        sid = k.get("args", {}).get("stream")
        streams[sid] = streams.get(sid, 0) + 1
    compute = max(streams, key=streams.get)  # the stream that runs most kernels: the model's
    busy = _intervals(kernels, lambda e: e.get("args", {}).get("stream") == compute)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
              and e.get("args", {}).get("bytes", 0) >= min_bytes]
    rows = []
    for c in copies:
        span = (c["ts"], c["ts"] + c.get("dur", 0))
        rows.append({"stream": c["args"].get("stream"), "bytes": c["args"].get("bytes"),
                     "us": c.get("dur", 0), "kind": c.get("name"), "under_compute_us": _overlap(span, busy)})
    side = [r for r in rows if r["stream"] != compute]
    total = sum(r["us"] for r in side)
    return {"compute_stream": compute, "embedding_copies": len(rows), "on_side_streams": len(side),
            "on_compute_stream": len(rows) - len(side),
            "side_copy_us": total, "side_copy_us_under_compute": sum(r["under_compute_us"] for r in side),
            "fraction_under_compute": (sum(r["under_compute_us"] for r in side) / total) if total else None,
            "copies": rows}


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    exit_on_sigterm()
    model = resolve_model(args)
    logs = workdir(args.logs)
    encoder = encoder_service(model, logs, args.device, args.dtype,
                              ["--arena", "shm", "--cache-bytes", str(1 << 30)]).start()
    source = RemoteEmbeddingSource([encoder.address], device=args.device,
                                   transports=[common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE])
    engine = LLMEngine(EngineConfig(model, device=args.device, dtype=args.dtype, max_num_seqs=64,
                                    kv_cache_bytes=8 << 30 if args.device.startswith("cuda") else None,
                                    enforce_eager=args.enforce_eager),
                       embedding_source=source)
    try:
        text = PromptMaker(model, seed=0).text(64)
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        for i in range(args.text_requests):
            engine.add_request(f"text-{i}", text, sampling=long)
        for _ in range(8):
            engine.step()  # prefilled, decoding
        images = [random_png(7000 + i, args.image_size) for i in range(args.images)]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i, img in enumerate(images):
                engine.add_request(f"img-{i}", PROMPT, [img], sampling=SamplingParams(max_tokens=4))
                for _ in range(6):
                    engine.step()
            deadline = time.monotonic() + 60
            while any(engine.scheduler.get(f"img-{i}") for i in range(len(images))):
                engine.step()
                if time.monotonic() > deadline:
                    break
            if torch.device(args.device).type == "cuda":
                torch.cuda.synchronize()
        trace_path = Path(args.trace) if args.trace else logs / "copy_overlap_trace.json"
        prof.export_chrome_trace(str(trace_path))
        embedding_bytes = engine.model_config.hidden_size * 64 * engine.dtype.itemsize  # >= 64 rows
        opener = gzip.open if trace_path.suffix == ".gz" else open
        with opener(trace_path, "rt") as f:
            result = analyze(json.load(f), embedding_bytes)
        result["transports"] = dict(source.stats().embedding_transports)
        result["trace"] = str(trace_path)
    finally:
        source.close()
        encoder.stop()
    keys = ["embedding_copies", "on_side_streams", "on_compute_stream", "side_copy_us",
            "fraction_under_compute", "transports"]
    print_table("embedding uploads (SHM -> GPU) during decode steps",
                ["copies", "on side streams", "on compute stream", "side copy us", "of it under compute",
                 "transports"], [[result.get(k) for k in keys]])
    return save_result("copy_overlap", args, {k: v for k, v in result.items() if k != "copies"},
                       copies=result.get("copies"))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
