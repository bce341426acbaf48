"""The asyncio load generator: sends BenchRequests to a decoder and times every streamed chunk."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.stats import summarize
from bench.workload import BenchRequest
from common.client import AsyncDecoderClient


@dataclass
class RequestRecord:
    """What one request measured: send time, chunk arrival times, tokens and usage."""

    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    images_skipped_by_kv_reuse: int = 0
    images_encoder_cache_hits: int = 0
    repeat: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the request finished without an error and produced a token."""
        return not self.error and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        """Seconds from send to the first token."""
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        """Seconds from send to the last chunk."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None for one-token outputs."""
        if self.completion_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (a chunk may carry several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass
class LoadConfig:
    """How to send: concurrency cap, Poisson request rate (inf: all at once), sampling settings."""

    concurrency: int = 8
    request_rate: float = float("inf")
    output_len: int = 32
    ignore_eos: bool = True
    timeout: float = 600.0
    cache_salt: str = ""
    seed: int = 0


async def _one(client: AsyncDecoderClient, req: BenchRequest, cfg: LoadConfig) -> RequestRecord:
    rec = RequestRecord(repeat=req.repeat)
    images = [req.image] if req.image is not None else []
    rec.start = time.perf_counter()
    try:
        async for chunk in client.generate(req.prompt, images, max_tokens=cfg.output_len,
                                           ignore_eos=cfg.ignore_eos, cache_salt=cfg.cache_salt):
            now = time.perf_counter()
            if chunk.token_ids:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(chunk.token_ids))
            if chunk.finish_reason:
                u = chunk.usage
                rec.prompt_tokens, rec.completion_tokens = u.prompt_tokens, u.completion_tokens
                rec.cached_prompt_tokens = u.cached_prompt_tokens
                rec.images_skipped_by_kv_reuse = u.images_skipped_by_kv_reuse
                rec.images_encoder_cache_hits = u.images_encoder_cache_hits
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()
    if not rec.completion_tokens:
        rec.completion_tokens = sum(rec.chunk_tokens)
    return rec


async def run_load(address: str, requests: Sequence[BenchRequest], cfg: LoadConfig,
                   progress: bool = True, desc: str = "requests") -> tuple[list[RequestRecord], float]:
    """Send every request (Poisson arrivals at cfg.request_rate, at most cfg.concurrency in flight).

    Returns the records in request order and the wall time of the whole run in seconds.
    """
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, leave=False)
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    rng = random.Random(cfg.seed)
    async with AsyncDecoderClient(address, timeout=cfg.timeout) as client:

        async def guarded(req: BenchRequest) -> RequestRecord:
            async with sem:
                rec = await _one(client, req, cfg)
            if bar is not None:
                bar.update(1)
            return rec

        started = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if cfg.request_rate != float("inf") and cfg.request_rate > 0:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return list(records), duration


def summarize_records(records: Sequence[RequestRecord], duration: float) -> dict:
    """Throughput and latency summaries (TTFT, TPOT, ITL, E2E: mean/p50/p99 ms) of a run."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration if duration else None,
        "output_token_throughput_tps": out_tokens / duration if duration else None,
        "total_output_tokens": out_tokens,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else None,
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "usage_cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "usage_images_skipped_by_kv_reuse": sum(r.images_skipped_by_kv_reuse for r in ok),
        "usage_images_encoder_cache_hits": sum(r.images_encoder_cache_hits for r in ok),
        "ttft": summarize([r.ttft for r in ok]),
        "tpot": summarize([t for r in ok if (t := r.tpot) is not None]),
        "itl": summarize([g for r in ok for g in r.itls]),
        "e2e": summarize([r.e2e for r in ok]),
    }


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Raw latencies in seconds per metric, for CDF plots."""
    ok = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2e": [r.e2e for r in ok],
    }
