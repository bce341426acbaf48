"""Soak of a Qwen2.5-VL or Qwen3-VL pair: many clients, mixed and hostile requests, then leak checks.

    python -m bench.soak --model DIR [--device cuda --dtype bfloat16] [--clients 96] [--seconds 240]
                         [--out soak.json]

Spawns one encoder and one decoder (bench.services), then:
1. a fixed greedy reference request (one fixed image + fixed text, 16 tokens, temperature 0);
2. a warm-up load (--warmup-seconds), the services left to go idle, memory measured ("before");
3. the load: --clients concurrent asyncio clients for --seconds, each looping over a random mix of
   requests with one or two noise images (PNG or JPEG, --min-image-size to --max-image-size a side,
   about half from a small hot pool so encoder and prefix caches hit), a short MPEG-4 clip (made here
   with PyAV), text only, and hostile inputs (a truncated PNG, bytes that are no image, an unknown
   content hash, more image markers than images, NaN temperature, an oversized cache_salt, max_tokens
   beyond the context, a truncated clip); max_tokens 1-64; about --cancel-fraction of the requests
   hang up after their first token or after a short random delay;
4. the services left to go idle (stats polled for up to --idle-timeout s), then the leak checks:
   decoder running, waiting, kv_blocks_used and active_leases all 0, encoder active_leases and
   leased_bytes 0 and no lease expired during the run (an unreleased lease the TTL cleaned up);
   memory measured ("after"): RSS of each service (its child processes included) and, on CUDA, the GPU
   memory of each (nvidia-smi --query-compute-apps);
5. the reference request again under a fresh cache salt (the cold path, as in 1): identical tokens.
   The same request under the first salt (encoder-cache and prefix-KV hits) is reported beside it.
   With --deterministic (both services' flag) the warm run must be identical too, and every run's
   logprobs as well as its tokens (the reference asks for its tokens' logprobs and top 2).
Each hostile case is also sent once during the load (so a short run covers them all). Lines of the
service logs that look like faults (tracebacks, ERROR) are reported in the JSON, not checked.

A hostile request must end in a clean client error (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED or
OUT_OF_RANGE); any other status of a hostile request and any error of a normal one is unexpected.
Results are saved as benchmark `qwen_soak` (`qwen3_soak` for Qwen3-VL); the exit code is 1 when a check
fails: an unexpected status, a leak, memory growth over the limits, a reference mismatch, a service
that died, or the overall deadline passed.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import os
import random
import subprocess
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from bench.qwen_gpu import family_of
from bench.report import print_table, save_result
from bench.services import Pair
from bench.stats import summarize
from bench.svcstats import decoder_stats, delta, encoder_stats
from bench.workload import QWEN_END, QWEN_IMAGE, QWEN_USER, random_png, random_words
from common.client import AsyncDecoderClient, generate_request
from common.pb import decoder_pb2

QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# The statuses a hostile request may end with (API.md: a client's error, never a fault of the server).
CLEAN_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE})
HOSTILE_CASES = ("truncated_png", "not_an_image", "unknown_hash", "extra_image_markers", "nan_temperature",
                 "oversized_cache_salt", "max_tokens_beyond_context", "truncated_video")
# Side lengths of the noise images (a few non-square ones too); clipped to --min/--max-image-size.
IMAGE_SIDES = (64, 128, 224, 320, 448, 640, 896, 1024, 1280)
REFERENCE_TEXT = "Describe the picture in one short sentence, please."
REFERENCE_TOKENS = 16
MAX_UNEXPECTED_KEPT = 50
MEMORY_FIGURES = ("rss_mib", "rss_tree_mib", "rss_anon_tree_mib", "rss_shmem_tree_mib", "gpu_mib")
DECODER_COUNTERS = ("requests_finished", "requests_aborted", "requests_failed", "preemptions",
                    "images_encoded", "images_encoder_cache_hits", "images_skipped_by_kv_reuse",
                    "images_prefetched", "lookahead_ready_at_prefill", "lookahead_waited_at_prefill",
                    "lookahead_boosted", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
ENCODER_COUNTERS = ("hits", "misses", "evictions", "encodes", "expired_leases", "inflight_dedups",
                    "prefetches")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the soak."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen2.5-VL or Qwen3-VL checkpoint directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", type=int, default=96, help="concurrent clients")
    p.add_argument("--seconds", type=float, default=240.0, help="length of the measured load")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="load before the 'before' memory figures (default: 10%% of --seconds, 1-30 s)")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels the clients share")
    p.add_argument("--min-image-size", type=int, default=64)
    p.add_argument("--max-image-size", type=int, default=1280)
    p.add_argument("--hot-images", type=int, default=12, help="images reused across requests (cache hits)")
    p.add_argument("--repeat-fraction", type=float, default=0.5, help="image requests using a hot image")
    p.add_argument("--no-video", action="store_true", help="no video requests")
    p.add_argument("--clips", type=int, default=3, help="distinct clips (reused)")
    p.add_argument("--clip-seconds", type=float, default=2.0)
    p.add_argument("--clip-fps", type=int, default=8)
    p.add_argument("--clip-size", type=int, default=224, help="square frames, pixels a side (even)")
    p.add_argument("--video-fraction", type=float, default=0.1)
    p.add_argument("--text-fraction", type=float, default=0.2)
    p.add_argument("--hostile-fraction", type=float, default=0.08)
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="requests the client hangs up on")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens drawn from 1..this")
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds to wait for the services to go idle")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the services to start")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for everything after start-up (default: derived from the others)")
    p.add_argument("--max-rss-growth-mib", type=float, default=512.0,
                   help="private RSS growth per service (children included) that fails the run")
    p.add_argument("--max-gpu-growth-mib", type=float, default=2048.0,
                   help="GPU memory growth per service (CUDA) that fails the run")
    p.add_argument("--kv-cache-bytes", type=int, default=16 << 30, help="the decoder's KV cache, on CUDA")
    p.add_argument("--encoder-cache-bytes", type=int, default=16 << 30, help="the encoder's arena, on CUDA")
    p.add_argument("--encoder-stall-exit", type=float, default=None,
                   help="the encoder's --stall-exit: a tower owing work without a step this long makes it "
                        "log every thread's stack and exit (default: the encoder's)")
    p.add_argument("--deterministic", action="store_true",
                   help="both services' --deterministic; the reference must then repeat bit for bit (warm "
                   "too, logprobs too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for the service logs (default: a fresh one)")
    p.add_argument("--out", default=None)
    return p


# --- inputs ----------------------------------------------------------------------------------------

def noise_image(seed: int, width: int, height: int, fmt: str = "PNG") -> bytes:
    """A width x height image of uniform noise, PNG or JPEG: each seed its own pixels (and hash)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    if fmt == "JPEG":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    else:
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def image_sides(lo: int, hi: int) -> list[int]:
    """IMAGE_SIDES within [lo, hi], and both ends."""
    return sorted({lo, hi, *(s for s in IMAGE_SIDES if lo <= s <= hi)})


def random_image_spec(rng: random.Random, sides: list[int]) -> tuple[int, int, str]:
    """(width, height, format): square three times in four, else two different sides."""
    w = rng.choice(sides)
    h = w if rng.random() < 0.75 else rng.choice(sides)
    return w, h, rng.choice(("PNG", "JPEG"))


def make_clips(args: argparse.Namespace) -> list[bytes]:
    """args.clips short MPEG-4 clips (bench.video_serve's moving textures), or none with --no-video."""
    if args.no_video or args.clips <= 0:
        return []
    from bench.video_serve import make_clip

    return [make_clip(args.clip_seconds, args.clip_fps, args.clip_size, seed=7000 + i, codec="mpeg4")
            for i in range(args.clips)]


def prompt(text: str, images: int = 0, videos: int = 0) -> str:
    """A Qwen-VL ChatML user turn: the vision markers, then the text."""
    return QWEN_USER + QWEN_IMAGE * images + QWEN_VIDEO * videos + text + QWEN_END


def reference_request(image: bytes, salt: str) -> decoder_pb2.GenerateRequest:
    """The fixed greedy request whose tokens must not change: 16 tokens, EOS ignored, with each token's
    logprob and the top 2."""
    return generate_request(prompt(REFERENCE_TEXT, images=1), [image], max_tokens=REFERENCE_TOKENS,
                            temperature=0.0, ignore_eos=True, cache_salt=salt, logprobs=2)


@dataclass
class Job:
    """One request of the load: what it is, and how the client ends it."""

    kind: str  # image, video, text or hostile
    request: decoder_pb2.GenerateRequest
    case: str = ""  # the hostile case
    cancel: str = ""  # "", "first_token" or "delay"
    cancel_after_s: float = 0.0


class Workload:
    """Random jobs: images (hot or fresh), videos, text only, hostile cases, some cancelled."""

    def __init__(self, args: argparse.Namespace, clips: list[bytes]) -> None:
        self.args = args
        self.clips = clips
        self.sides = image_sides(args.min_image_size, args.max_image_size)
        rng = random.Random(args.seed)
        self.hot = [noise_image(args.seed * 1000 + i, *random_image_spec(rng, self.sides))
                    for i in range(max(1, args.hot_images))]
        self.texts = [random_words(rng, rng.randint(4, 24)) for _ in range(8)]  # repeated: prefix hits
        self.cases = [c for c in HOSTILE_CASES if clips or c != "truncated_video"]

    def salt(self, rng: random.Random) -> str:
        """Mostly a few shared tenants (caches hit), sometimes a fresh one (everything misses)."""
        return rng.choice(("", "", "soak-a", "soak-b", f"soak-{uuid.uuid4().hex[:8]}"))

    def text(self, rng: random.Random) -> str:
        return rng.choice(self.texts) if rng.random() < 0.5 else random_words(rng, rng.randint(2, 40))

    def sampling(self, rng: random.Random) -> dict:
        """max_tokens 1..--max-tokens, greedy or sampled, EOS sometimes ignored."""
        out = {"max_tokens": rng.randint(1, self.args.max_tokens), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.5:
            out.update(temperature=rng.choice((0.7, 1.0)), top_p=rng.choice((0.0, 0.9)),
                       top_k=rng.choice((0, 20)), seed=rng.randrange(1 << 31))
        return out

    async def image(self, rng: random.Random) -> bytes:
        """A hot image or a fresh one (made off the event loop)."""
        if rng.random() < self.args.repeat_fraction:
            return rng.choice(self.hot)
        spec = random_image_spec(rng, self.sides)
        return await asyncio.to_thread(noise_image, rng.randrange(1 << 40), *spec)

    async def job(self, rng: random.Random) -> Job:
        """The next job, drawn by the fractions of the options."""
        a = self.args
        r = rng.random()
        if r < a.hostile_fraction:
            case = rng.choice(self.cases)
            return Job("hostile", await self.hostile(case, rng), case=case)
        r -= a.hostile_fraction
        salt = self.salt(rng)
        if r < a.text_fraction:
            job = Job("text", generate_request(prompt(self.text(rng)), cache_salt=salt, **self.sampling(rng)))
        elif self.clips and r < a.text_fraction + a.video_fraction:
            request = generate_request(prompt(self.text(rng), videos=1), cache_salt=salt,
                                       **self.sampling(rng))
            request.videos.add(data=rng.choice(self.clips))
            job = Job("video", request)
        else:
            images = [await self.image(rng) for _ in range(rng.choice((1, 1, 2)))]
            job = Job("image", generate_request(prompt(self.text(rng), images=len(images)), images,
                                                cache_salt=salt, **self.sampling(rng)))
        if rng.random() < a.cancel_fraction:
            job.cancel = rng.choice(("first_token", "delay"))
            job.cancel_after_s = rng.uniform(0.0, 0.5)
        return job

    async def hostile(self, case: str, rng: random.Random) -> decoder_pb2.GenerateRequest:
        """The request of one hostile case."""
        text, sampling = self.text(rng), {"max_tokens": rng.randint(1, self.args.max_tokens)}
        if case == "truncated_png":
            png = rng.choice([h for h in self.hot if h.startswith(b"\x89PNG")] or [random_png(1, 64)])
            cut = max(64, len(png) // rng.randint(2, 8))  # the header and a part of the pixels
            return generate_request(prompt(text, 1), [png[:cut]], **sampling)
        if case == "not_an_image":
            return generate_request(prompt(text, 1), [b"this is not an image, just bytes " * 8], **sampling)
        if case == "unknown_hash":
            return generate_request(prompt(text, 1), [f"hash:{uuid.uuid4().hex * 2}"], **sampling)
        if case == "extra_image_markers":
            return generate_request(prompt(text, 2), [await self.image(rng)], **sampling)
        if case == "nan_temperature":
            return generate_request(prompt(text), temperature=math.nan, **sampling)
        if case == "oversized_cache_salt":
            return generate_request(prompt(text), cache_salt="s" * 4096, **sampling)
        if case == "max_tokens_beyond_context":
            return generate_request(prompt(text), max_tokens=(1 << 32) - 1)
        if case == "truncated_video":
            clip = rng.choice(self.clips)
            request = generate_request(prompt(text, videos=1), **sampling)
            request.videos.add(data=clip[: len(clip) // 3])
            return request
        raise ValueError(f"unknown hostile case {case!r}")


# --- running requests ------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How one request ended."""

    kind: str
    outcome: str  # ok, cancelled, refused (a hostile request's clean error) or unexpected
    case: str = ""
    code: str = ""
    details: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0


@dataclass
class _Stream:
    """What a stream delivered so far."""

    started: float
    ttft_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0

    def add(self, chunk: decoder_pb2.GenerateResponse) -> None:
        if chunk.token_ids and self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


async def _read(call, stream: _Stream, stop_at_first_token: bool = False) -> None:
    """Read the call into stream (to its end, or to its first token)."""
    async for chunk in call:
        stream.add(chunk)
        if stop_at_first_token and stream.token_ids:
            return


async def run_job(stub, job: Job, timeout: float) -> Outcome:
    """Send one job and classify how it ended."""
    stream = _Stream(time.perf_counter())
    call = stub.Generate(job.request, timeout=timeout)
    hung_up = False
    reader = asyncio.ensure_future(_read(call, stream, job.cancel == "first_token"))
    try:
        if job.cancel == "delay":
            done, _ = await asyncio.wait({reader}, timeout=job.cancel_after_s)
            if not done:
                hung_up = call.cancel()
        else:
            await asyncio.wait({reader})
            if job.cancel == "first_token" and not stream.finish_reason:
                hung_up = call.cancel()
        await asyncio.wait({reader})
    finally:  # our own task cancelled (the overall deadline): leave nothing running
        call.cancel()
        reader.cancel()
    return classify(job, stream, reader, hung_up)


def classify(job: Job, stream: _Stream, reader: asyncio.Future, hung_up: bool) -> Outcome:
    """The Outcome of a finished reader task."""
    out = Outcome(job.kind, "ok", case=job.case, ttft_s=stream.ttft_s,
                  e2e_s=time.perf_counter() - stream.started, tokens=len(stream.token_ids))
    exc = None if reader.cancelled() else reader.exception()
    if hung_up and (reader.cancelled() or _code(exc) == grpc.StatusCode.CANCELLED or exc is None):
        out.outcome = "cancelled"
        return out
    if reader.cancelled():
        out.outcome, out.code = "unexpected", "CANCELLED"
        return out
    if exc is not None:
        code = _code(exc)
        out.code = code.name if code is not None else type(exc).__name__
        out.details = (exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details")
                       else str(exc)) or ""
        out.details = out.details[:300]
        out.outcome = "refused" if job.kind == "hostile" and code in CLEAN_CODES else "unexpected"
        return out
    if job.kind == "hostile":
        out.outcome, out.details = "unexpected", "a hostile request was served"
    elif stream.finish_reason not in (decoder_pb2.FINISH_REASON_STOP, decoder_pb2.FINISH_REASON_LENGTH):
        out.outcome = "unexpected"
        out.details = f"finish_reason {decoder_pb2.FinishReason.Name(stream.finish_reason)}"
    return out


def _code(exc: BaseException | None) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None


async def client_loop(index: int, stubs: list, workload: Workload, until: float, timeout: float,
                      outcomes: list[Outcome], alive: Callable[[], bool] = lambda: True) -> None:
    """One client: jobs one after another until `until` (monotonic), or until a service dies."""
    rng = random.Random(workload.args.seed * 100_003 + index)
    stub = stubs[index % len(stubs)]
    while time.monotonic() < until and alive():
        job = await workload.job(rng)
        outcomes.append(await run_job(stub, job, timeout))


async def hostile_sweep(stub, workload: Workload, timeout: float, outcomes: list[Outcome]) -> None:
    """Every hostile case once, one after another (beside the client loops: under load)."""
    rng = random.Random(workload.args.seed - 1)
    for case in workload.cases:
        job = Job("hostile", await workload.hostile(case, rng), case=case)
        outcomes.append(await run_job(stub, job, timeout))


async def run_load(address: str, workload: Workload, clients: int, seconds: float, channels: int,
                   timeout: float, sweep: bool = False,
                   alive: Callable[[], bool] = lambda: True) -> tuple[list[Outcome], float]:
    """`clients` client loops for `seconds` (and with `sweep` every hostile case once, beside them); their
    outcomes and the wall time (the last request included)."""
    outcomes: list[Outcome] = []
    conns = [AsyncDecoderClient(address) for _ in range(max(1, min(channels, clients)))]
    stubs = [c.stub for c in conns]
    t0 = time.monotonic()
    try:
        tasks = [client_loop(i, stubs, workload, t0 + seconds, timeout, outcomes, alive)
                 for i in range(clients)]
        if sweep:
            tasks.append(hostile_sweep(stubs[0], workload, timeout, outcomes))
        await asyncio.gather(*tasks)
    finally:
        for c in conns:
            await c.close()
    return outcomes, time.monotonic() - t0


def summarize_outcomes(outcomes: list[Outcome], wall_s: float) -> dict:
    """Counts by outcome and kind, hostile statuses per case, unexpected errors, TTFT and tokens/s."""
    by_outcome = Counter(o.outcome for o in outcomes)
    ok = [o for o in outcomes if o.outcome == "ok" and o.kind != "hostile"]
    tokens = sum(o.tokens for o in outcomes)
    unexpected = [o for o in outcomes if o.outcome == "unexpected"]
    hostile = [o for o in outcomes if o.kind == "hostile"]
    return {
        "requests": len(outcomes),
        "by_outcome": {k: by_outcome.get(k, 0) for k in ("ok", "cancelled", "refused", "unexpected")},
        "by_kind": {f"{kind}/{res}": n for (kind, res), n in
                    sorted(Counter((o.kind, o.outcome) for o in outcomes).items())},
        "hostile": {f"{case}/{code}": n for (case, code), n in
                    sorted(Counter((o.case, o.code or "OK") for o in hostile).items())},
        "hostile_cases_refused": sorted({o.case for o in hostile if o.outcome == "refused"}),
        "unexpected_by_code": dict(Counter(f"{o.kind}/{o.case or '-'}/{o.code or 'OK'}" for o in unexpected)),
        "unexpected": [{"kind": o.kind, "case": o.case, "code": o.code, "details": o.details}
                       for o in unexpected[:MAX_UNEXPECTED_KEPT]],
        "ttft": summarize([o.ttft_s for o in ok if o.ttft_s is not None]),
        "e2e": summarize([o.e2e_s for o in ok]),
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(outcomes) / wall_s if wall_s > 0 else None,
    }


async def reference_tokens(address: str, image: bytes, salt: str, timeout: float,
                           logprobs: list | None = None) -> list[int]:
    """The reference request's tokens (raises on any error); its logprobs ([logprob, top ids, top
    logprobs] per token) appended to `logprobs` when given."""
    async with AsyncDecoderClient(address, timeout=timeout) as client:
        tokens: list[int] = []
        async for chunk in client.stub.Generate(reference_request(image, salt), timeout=timeout):
            tokens.extend(chunk.token_ids)
            if logprobs is not None:
                logprobs += [[lp.logprob, list(lp.top_ids), list(lp.top_logprobs)] for lp in chunk.logprobs]
        return tokens


# --- idle and leak checks --------------------------------------------------------------------------

def leak_checks(dec: dict, enc: dict) -> dict[str, bool]:
    """Each idle-state check on the two services' stats: True when it passes."""
    return {
        "decoder_running_0": dec.get("running") == 0,
        "decoder_waiting_0": dec.get("waiting") == 0,
        "decoder_kv_blocks_used_0": dec.get("kv_blocks_used") == 0,
        "decoder_active_leases_0": dec.get("active_leases") == 0,
        "encoder_active_leases_0": enc.get("active_leases") == 0,
        "encoder_leased_bytes_0": enc.get("leased_bytes") == 0,
    }


def _plain(stats: dict) -> dict:
    """Stats with protobuf maps as dicts (JSON-able)."""
    return {k: dict(v) if hasattr(v, "items") else v for k, v in stats.items()}


async def wait_idle(pair: Pair, timeout: float) -> tuple[dict, dict, float]:
    """Poll both services' stats until every leak check passes or `timeout` s pass; the last stats and the
    seconds waited."""
    t0 = time.monotonic()
    while True:
        dec = _plain(await asyncio.to_thread(decoder_stats, pair.decoder.address))
        enc = _plain(await asyncio.to_thread(encoder_stats, pair.encoder.address))
        waited = time.monotonic() - t0
        if all(leak_checks(dec, enc).values()) or waited >= timeout:
            return dec, enc, round(waited, 2)
        await asyncio.sleep(0.5)


# --- memory ----------------------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of one process in MiB: all of it (VmRSS), its private part (RssAnon) and shared
    memory pages (RssShmem: the encoder's SHM arena as the cache fills, and the decoder's view of it);
    zeros when it is gone."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem"}
    out = dict.fromkeys(keys.values(), 0.0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(maxsplit=1)[0] if line else ""
            if key in keys:
                out[keys[key]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def gpu_memory_by_pid() -> dict[int, float]:
    """GPU memory in MiB per process, from nvidia-smi ({} without it)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = out.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                pass
    return out


def memory(pair: Pair, cuda: bool) -> dict:
    """RSS (own, and with child processes) and, on CUDA, GPU MiB of each service."""
    gpu = gpu_memory_by_pid() if cuda else {}
    out = {}
    for svc in (pair.decoder, pair.encoder):
        if svc.proc is None:
            continue
        tree = process_tree(svc.proc.pid)
        each = [rss_mib(p) for p in tree]  # tree[0] is the service itself
        out[svc.name] = {"pid": svc.proc.pid, "processes": len(tree), "rss_mib": round(each[0]["rss"], 1),
                         "rss_tree_mib": round(sum(m["rss"] for m in each), 1),
                         "rss_anon_tree_mib": round(sum(m["anon"] for m in each), 1),
                         "rss_shmem_tree_mib": round(sum(m["shmem"] for m in each), 1)}
        if cuda and gpu:  # nvidia-smi may list no process (another PID namespace): then no figure
            out[svc.name]["gpu_mib"] = sum(gpu.get(p, 0.0) for p in tree)
    if cuda and not gpu:
        out["gpu_note"] = "nvidia-smi listed no compute process: GPU memory per process unknown"
    return out


def encoder_device_memory(stats: dict) -> dict:
    """The encoder's device memory beside its arena (MiB, from its stats) and its tower graphs."""
    mib = 1 << 20
    return {"allocated_mib": round(int(stats.get("device_memory_allocated_bytes", 0)) / mib, 1),
            "reserved_mib": round(int(stats.get("device_memory_reserved_bytes", 0)) / mib, 1),
            "tower_graphs": int(stats.get("tower_graphs", 0))}


def memory_growth(before: dict, after: dict) -> dict:
    """after - before of each service's figures (MiB)."""
    return {name: {k: round(after[name][k] - before[name][k], 1)
                   for k in MEMORY_FIGURES if k in after[name] and k in before[name]}
            for name in ("decoder", "encoder") if name in after and name in before}


def memory_checks(growth: dict, max_rss_mib: float, max_gpu_mib: float) -> dict[str, bool]:
    """One check per service and figure: growth within its limit. RSS is the private (anonymous) part,
    children included: shared-memory pages grow as the SHM arena fills, which is no leak."""
    out = {}
    for name, g in growth.items():
        out[f"{name}_rss_growth_ok"] = g.get("rss_anon_tree_mib", math.inf) <= max_rss_mib
        if "gpu_mib" in g:
            out[f"{name}_gpu_growth_ok"] = g["gpu_mib"] <= max_gpu_mib
    return out


# --- the run ---------------------------------------------------------------------------------------

def warmup_seconds(args: argparse.Namespace) -> float:
    """--warmup-seconds, or 10% of --seconds within 1-30 s."""
    if args.warmup_seconds is not None:
        return max(0.0, args.warmup_seconds)
    return min(30.0, max(1.0, 0.1 * args.seconds))


def deadline_seconds(args: argparse.Namespace) -> float:
    """--deadline, or the load's seconds plus every timeout after it, with room to spare."""
    if args.deadline is not None:
        return args.deadline
    # each load may overrun by one request, and three reference requests
    return warmup_seconds(args) + args.seconds + 5 * args.request_timeout + 2 * args.idle_timeout + 120.0


async def soak(args: argparse.Namespace, pair: Pair, result: dict) -> None:
    """The phases after start-up, each one's figures into result as they come."""
    cuda = args.device.startswith("cuda")
    ref_image = noise_image(424242, min(448, args.max_image_size), min(448, args.max_image_size))
    ref_salt = f"ref-{uuid.uuid4().hex[:12]}"
    ref = result["reference"] = {}
    ref["logprobs_before"] = []
    ref["before"] = await reference_tokens(pair.decoder.address, ref_image, ref_salt, args.request_timeout,
                                           ref["logprobs_before"])
    print(f"reference before: {ref['before']}", flush=True)
    clips = await asyncio.to_thread(make_clips, args)
    workload = Workload(args, clips)
    result["workload"] = {"hot_images": len(workload.hot), "image_sides": workload.sides,
                          "clips": len(clips), "clip_bytes": [len(c) for c in clips],
                          "hostile_cases": workload.cases}
    warm = warmup_seconds(args)

    def alive() -> bool:  # clients stop when a service dies
        return all(services_alive(pair).values())

    if warm > 0:
        outcomes, wall = await run_load(pair.decoder.address, workload, args.clients, warm, args.channels,
                                        args.request_timeout, alive=alive)
        result["warmup"] = summarize_outcomes(outcomes, wall)
        print(f"warm-up: {result['warmup']['by_outcome']} in {wall:.1f} s", flush=True)
    dec0, enc0, waited = await wait_idle(pair, args.idle_timeout)
    result["idle_before"] = {"waited_s": waited, "checks": leak_checks(dec0, enc0)}
    result["memory_before"] = memory(pair, cuda)
    print(f"memory before: {result['memory_before']}", flush=True)
    outcomes, wall = await run_load(pair.decoder.address, workload, args.clients, args.seconds, args.channels,
                                    args.request_timeout, sweep=True, alive=alive)
    result["load"] = summarize_outcomes(outcomes, wall)
    print(f"load: {result['load']['by_outcome']} in {wall:.1f} s", flush=True)
    dec1, enc1, waited = await wait_idle(pair, args.idle_timeout)
    result["idle_after"] = {"waited_s": waited, "checks": leak_checks(dec1, enc1),
                            "decoder": {k: dec1.get(k) for k in ("running", "waiting", "kv_blocks_used",
                                                                 "kv_blocks_total", "kv_blocks_cached_free",
                                                                 "active_leases")},
                            "encoder": {k: enc1.get(k) for k in ("active_leases", "leased_bytes", "entries",
                                                                 "cache_bytes_used")}}
    result["decoder_counters"] = {k: v for k, v in delta(dec0, dec1).items() if k in DECODER_COUNTERS}
    result["encoder_counters"] = {k: v for k, v in delta(enc0, enc1).items() if k in ENCODER_COUNTERS}
    result["expired_leases_total"] = enc1.get("expired_leases")
    result["memory_after"] = memory(pair, cuda)
    result["memory_growth"] = memory_growth(result["memory_before"], result["memory_after"])
    # What the encoder's GPU figure is made of (torch's allocator): tensors, and its cache with the tower
    # graphs' pools. Reported, not checked: gpu_mib's growth is the check.
    result["encoder_device_memory"] = {"before": encoder_device_memory(enc0),
                                       "after": encoder_device_memory(enc1)}
    print(f"memory after: {result['memory_after']}", flush=True)
    address, timeout = pair.decoder.address, args.request_timeout
    ref["logprobs_after_cold"], ref["logprobs_after_warm"] = [], []
    ref["after_cold"] = await reference_tokens(address, ref_image, f"ref-{uuid.uuid4().hex[:12]}", timeout,
                                               ref["logprobs_after_cold"])
    ref["after_warm"] = await reference_tokens(address, ref_image, ref_salt, timeout,
                                               ref["logprobs_after_warm"])
    ref["warm_matches"] = ref["after_warm"] == ref["before"]
    ref["logprobs_match"] = {run: ref[f"logprobs_{run}"] == ref["logprobs_before"]
                             for run in ("after_cold", "after_warm")}
    print(f"reference after: {ref['after_cold']} (warm: {ref['after_warm']})", flush=True)


def deterministic_checks(ref: dict) -> dict[str, bool]:
    """The deterministic mode's promise: the warm run's tokens too, and every run's logprobs, identical."""
    return {"reference_warm_tokens_identical": bool(ref.get("warm_matches")),
            "reference_logprobs_identical": bool(ref.get("logprobs_match"))
            and all(ref["logprobs_match"].values())}


def checks_of(result: dict, args: argparse.Namespace, alive: dict[str, bool]) -> dict[str, bool]:
    """Every pass/fail check of a run (a phase that never ran fails its checks)."""
    load, warm = result.get("load", {}), result.get("warmup", {})
    ref = result.get("reference", {})
    checks = {
        "no_error": "error" not in result,
        "services_alive": all(alive.values()) and bool(alive),
        "requests_served": load.get("by_outcome", {}).get("ok", 0) > 0,
        "no_unexpected_status": ("by_outcome" in load and load["by_outcome"]["unexpected"] == 0
                                 and warm.get("by_outcome", {}).get("unexpected", 0) == 0),
        "reference_tokens_identical": (len(ref.get("before", [])) == REFERENCE_TOKENS
                                       and ref.get("after_cold") == ref.get("before")),
        **(deterministic_checks(ref) if args.deterministic else {}),
        "hostile_cases_all_refused": ("workload" in result and set(load.get("hostile_cases_refused", ()))
                                      == set(result["workload"]["hostile_cases"])),
        "no_expired_leases": ("encoder_counters" in result
                              and result["encoder_counters"].get("expired_leases", 1) == 0),
    }
    idle = result.get("idle_after", {}).get("checks") or dict.fromkeys(leak_checks({}, {}), False)
    checks.update(idle)
    growth = result.get("memory_growth")
    if growth:
        checks.update(memory_checks(growth, args.max_rss_growth_mib, args.max_gpu_growth_mib))
    else:
        checks["memory_measured"] = False
    return checks


def headline(label: str, result: dict) -> list[list]:
    """The headline rows."""
    load = result.get("load", {})
    by = load.get("by_outcome", {})
    ttft = load.get("ttft", {})
    failed = [k for k, v in result.get("checks", {}).items() if not v]
    growth = result.get("memory_growth", {})
    return [
        [f"{label} soak requests ok / cancelled / refused / unexpected",
         " / ".join(str(by.get(k)) for k in ("ok", "cancelled", "refused", "unexpected")) if by else None],
        [f"{label} soak TTFT p50 / p99 ms",
         f"{ttft['p50_ms']:.1f} / {ttft['p99_ms']:.1f}" if ttft.get("n") else None],
        [f"{label} soak tokens/s", round(load["tokens_per_s"], 1) if load.get("tokens_per_s") else None],
        [f"{label} soak private RSS growth MiB (decoder / encoder)",
         " / ".join(str(growth.get(s, {}).get("rss_anon_tree_mib")) for s in ("decoder", "encoder"))
         if growth else None],
        [f"{label} soak checks", "pass" if not failed else "FAIL: " + ", ".join(failed)],
    ]


def print_summary(result: dict) -> None:
    """The outcome and check tables on stdout."""
    load = result.get("load", {})
    if load:
        rows = [[k, v] for k, v in load["by_kind"].items()] + [[k, v] for k, v in load["hostile"].items()]
        print_table("requests (kind/outcome, hostile case/status)", ["", "count"], rows)
        for u in load["unexpected"][:10]:
            print(f"unexpected: {u}")
    print_table("checks", ["check", "pass"], [[k, v] for k, v in result.get("checks", {}).items()])
    for name, lines in result.get("log_problems", {}).items():  # reported, not a check
        print(f"{name} log: {len(lines)} line(s) of errors, e.g.:\n  " + "\n  ".join(lines[:6]))


def services_alive(pair: Pair) -> dict[str, bool]:
    """Whether each service process still runs."""
    return {s.name: s.proc is not None and s.proc.poll() is None for s in (pair.decoder, pair.encoder)}


def log_problems(pair: Pair, keep: int = 20) -> dict[str, list[str]]:
    """Lines of each service's log that look like a fault (tracebacks, ERROR, CRITICAL), the first `keep`."""
    out = {}
    for svc in (pair.decoder, pair.encoder):
        try:
            lines = svc.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        bad = [line[:300] for line in lines if any(m in line for m in ("Traceback", "ERROR", "CRITICAL"))]
        if bad:
            out[svc.name] = bad[:keep]
    return out


def service_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(encoder args, decoder args)."""
    enc = ["--cache-bytes", str(args.encoder_cache_bytes)] if args.device.startswith("cuda") else []
    if args.encoder_stall_exit is not None:
        enc += ["--stall-exit", str(args.encoder_stall_exit)]
    dec = ["--encoder-timeout", str(int(args.request_timeout))]
    if args.device.startswith("cuda"):
        dec += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.deterministic:
        enc.append("--deterministic")
        dec.append("--deterministic")
    return enc, dec


def main(argv: list[str] | None = None) -> int:
    """Spawn the pair, soak it, check it; print and save the JSON (always). 1 when a check fails."""
    args = build_arg_parser().parse_args(argv)
    label = family_of(args.model)[0]
    result: dict = {"model": args.model, "family": label, "device": args.device, "dtype": args.dtype}
    enc_args, dec_args = service_args(args)
    pair = Pair(args.model, args.device, args.dtype, enc_args, dec_args, args.logs)
    result["logs"] = str(pair.logs)
    alive: dict[str, bool] = {}
    try:
        t0 = time.perf_counter()
        pair.start(args.start_timeout)
        result["services_start_s"] = round(time.perf_counter() - t0, 1)
        print(f"services up in {result['services_start_s']} s (logs in {pair.logs})", flush=True)
        asyncio.run(asyncio.wait_for(soak(args, pair, result), deadline_seconds(args)))
    except Exception as exc:  # noqa: BLE001 - recorded; the JSON is still written
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:  # also on SIGTERM (SystemExit): stop the services, then save what there is
        alive = services_alive(pair)
        result["services_alive"] = alive
        if not all(alive.values()):
            result["log_tails"] = {s.name: s.log_tail(30) for s in (pair.decoder, pair.encoder)}
        pair.stop()
        result["log_problems"] = log_problems(pair)
        result["checks"] = checks_of(result, args, alive)
        result["headline"] = headline(label, result)
        save_result(f"{label}_soak", args, result, headline=result["headline"])
    print_summary(result)
    print(result["headline"], flush=True)
    return exit_code(result["checks"])


def exit_code(checks: dict[str, bool]) -> int:
    """0 when every check passed (and there was one), else 1."""
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
