"""Faults under load: a fleet behind one gateway, a steady open-loop load, and a schedule of faults.

    python -m bench.chaos --model DIR [--rate 1.0] [--steady-seconds 30] [--faults all] [--out chaos.json]

Topology on one machine (bench.services): 2 encoders, each behind a loopback TCP proxy this benchmark
owns (bench/fault_proxy.py); 2 decoders routed to both proxies; the gateway over the decoders listed in a
file (`--decoder file:PATH`), so a replacement decoder is found without restarting it. The load is
open-loop (Poisson arrivals at --rate): chat requests with an image (a small hot pool, so caches hit, and
fresh ones), a short video, or text only; streamed or not; `n` = 2 some of the time. The client follows
the documented retry policy: a 429 or 503 (before any byte of the response body) is retried after its
Retry-After (capped at --retry-cap), up to --max-retries times.

The faults, in order, each in a window of its own with steady load between them:
  encoder_kill    kill -9 one encoder; restart it on its port --restart-after s later
  decoder_drain   SIGTERM one decoder (it drains); start a replacement, list it in the gateway's file
                  once healthy, and drop the old one from the file once it has exited
  encoder_stall   SIGSTOP one encoder for --stall-seconds, then SIGCONT (busy and down told apart)
  link_faults     on one encoder's proxy: delay every chunk, reset every connection (RST), then drop
                  (hold connections, forward nothing), each for --link-fault-seconds
  cache_flood     every image request uses a fresh image, at --flood-rate, against encoders whose cache is
                  --encoder-cache-bytes (evictions while leases are held)
  decoder_kill    kill -9 one decoder (its engine core must follow it), drop it from the gateway's file
                  and start a replacement: requests it had not sent the client anything of go to the
                  other decoder (the gateway restarts them: counted as gateway_restarts); streams it was
                  sending are cut, counted apart from the lost

Reported: requests completed, retriable statuses seen before streaming, completed after a retry, the
gateway's own retries on another decoder (failovers before a first message, restarts after its decoder
went away; /metrics), lost
(anything else: an error after streaming began, another status, a broken connection); TTFT p50/p99 of
streamed requests in steady load and in each fault window; each fault's own figures (restart and drain
times, whether health said NOT_SERVING before the process stopped); after the run, every surviving
service's books (decoder running/waiting/KV blocks/leases, encoder leases/leased bytes), RSS after warm-up
and at the end, shm segments and processes left behind once everything stopped. Exit code 1 when a
request was lost, the books are not clean, something was orphaned, a drain overran --drain-timeout + 2 s,
or a service died unexpectedly.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.fault_proxy import FaultProxy
from bench.report import print_table, save_result
from bench.services import Service, decoder_service, encoder_service, exit_on_sigterm, workdir
from bench.soak import leak_checks, noise_image, process_tree, rss_mib
from bench.stats import clean, summarize
from bench.svcstats import decoder_stats, encoder_stats
from gateway.health import wait_until_http_healthy

FAULTS = ("encoder_kill", "decoder_drain", "encoder_stall", "link_faults", "cache_flood", "decoder_kill")
# A stream a decoder was sending when it was killed ends with an error after streaming began: no retry
# policy can finish it without replaying tokens. Such ends within this many seconds of a decoder_kill are
# counted apart ("cut by the kill"), not as lost; everything else must still complete.
KILL_CUT_WINDOW_S = 5.0
_CUT_STREAM_ENDS = ("error after streaming began", "stream ended early", "RemoteProtocolError")
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "mmserve-enc-"
RETRIABLE_STATUSES = (429, 503)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen2.5-VL checkpoint directory (the tiny one on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--steady-seconds", type=float, default=30.0, help="steady load before the first fault")
    p.add_argument("--gap-seconds", type=float, default=15.0, help="steady load after each fault")
    p.add_argument("--faults", default="all", help=f"comma-separated from {', '.join(FAULTS)}, or all")
    p.add_argument("--restart-after", type=float, default=5.0,
                   help="seconds before a killed encoder restarts")
    p.add_argument("--stall-seconds", type=float, default=10.0)
    p.add_argument("--link-fault-seconds", type=float, default=4.0)
    p.add_argument("--link-delay", type=float, default=0.3, help="seconds each proxied chunk waits")
    p.add_argument("--flood-seconds", type=float, default=10.0)
    p.add_argument("--flood-rate", type=float, default=3.0, help="requests per second during the flood")
    p.add_argument("--drain-timeout", type=float, default=15.0, help="the decoders' --drain-timeout")
    p.add_argument("--flood-image-side", type=int, default=1344,
                   help="pixels a side of the flood's images (1344: about 576 KiB of embedding each with "
                   "the tiny model), made before the load starts")
    p.add_argument("--encoder-cache-bytes", type=int, default=4 << 20,
                   help="each encoder's cache (arena); it must hold the largest image's embedding "
                   "(4 MiB for the tiny model)")
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="each decoder's KV cache")
    p.add_argument("--lease-ttl", type=float, default=10.0,
                   help="the encoders' --lease-ttl: a lease whose answer a broken link lost is collected "
                   "then (counted as expired), within --idle-timeout")
    p.add_argument("--hot-images", type=int, default=6)
    p.add_argument("--image-sides", default="56,84,112", help="side lengths of the images, pixels")
    p.add_argument("--text-fraction", type=float, default=0.3)
    p.add_argument("--video-fraction", type=float, default=0.1)
    p.add_argument("--stream-fraction", type=float, default=0.6)
    p.add_argument("--n2-fraction", type=float, default=0.1, help="requests with n = 2")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--kill-wait-seconds", type=float, default=10.0,
                   help="decoder_kill waits up to this long for requests on its victim")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--max-retries", type=int, default=8)
    p.add_argument("--retry-cap", type=float, default=1.0, help="most seconds waited on one Retry-After")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds for the books to come clean (at least --lease-ttl)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


# --- the fleet ---------------------------------------------------------------------------------------

class GatewayService(Service):
    """The gateway: ready when GET /health answers 200 (a decoder is SERVING)."""

    def wait(self, timeout: float = 600.0) -> Service:
        if not wait_until_http_healthy(f"http://{self.address}/health", timeout,
                                       is_alive=lambda: self.proc.poll() is None):
            self.stop()
            raise RuntimeError(f"{self.name} did not become healthy; log:\n{self.log_tail()}")
        return self


@dataclass
class Fleet:
    """Two encoders behind proxies, the decoders, the gateway, and the file listing the decoders."""

    args: argparse.Namespace
    logs: Path
    encoders: list[Service] = field(default_factory=list)
    proxies: list[FaultProxy] = field(default_factory=list)
    decoders: dict[str, Service] = field(default_factory=dict)  # listed in the gateway's file
    gateway: Service | None = None
    pids: set[tuple[int, int]] = field(default_factory=set)  # (pid, start time) of every process of ours
    died: list[str] = field(default_factory=list)  # services that exited without being told to
    _decoders_made: int = 0

    @property
    def listing(self) -> Path:
        return self.logs / "decoders.txt"

    def write_listing(self) -> None:
        tmp = self.listing.with_suffix(".tmp")
        tmp.write_text("".join(f"{d.address}\n" for d in self.decoders.values()))
        tmp.replace(self.listing)  # atomic: the gateway never reads half a file

    def new_decoder(self) -> Service:
        a = self.args
        name = f"decoder{self._decoders_made}"
        self._decoders_made += 1
        extra = ["--encoder", self.proxies[1].address, "--encoder-resolve-interval", "1",
                 "--drain-timeout", str(a.drain_timeout), "--kv-cache-bytes", str(a.kv_cache_bytes)]
        return decoder_service(a.model, self.proxies[0].address, self.logs, a.device, a.dtype, extra, name)

    def start(self) -> None:
        a = self.args
        cache = ["--cache-bytes", str(a.encoder_cache_bytes), "--lease-ttl", str(a.lease_ttl)]
        self.encoders = [encoder_service(a.model, self.logs, a.device, a.dtype, cache, f"encoder{i}")
                         for i in range(2)]
        self.proxies = [FaultProxy(e.port).start() for e in self.encoders]
        first = [self.new_decoder(), self.new_decoder()]
        self.gateway = GatewayService("gateway", ["gateway", "--decoder", f"file:{self.listing}",
                                                  "--decoder-check-interval", "1", "--model", str(a.model)],
                                      self.logs / "gateway.log")
        exit_on_sigterm()
        services = [*self.encoders, *first]
        try:
            for s in services:
                s.launch()
            for s in services:
                s.wait(a.start_timeout)
            self.decoders = {d.name: d for d in first}
            self.write_listing()
            self.gateway.launch().wait(a.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.note_pids()

    def services(self) -> list[Service]:
        return [s for s in [*self.encoders, *self.decoders.values(), self.gateway] if s is not None]

    def note_pids(self) -> None:
        for s in self.services():
            if s.proc is not None and s.proc.poll() is None:
                self.pids.update(identities(process_tree(s.proc.pid)))

    def check_alive(self) -> None:
        for s in self.services():
            if s.proc is not None and s.proc.poll() is not None and s.name not in self.died:
                self.died.append(s.name)

    def stop(self) -> None:
        for s in [self.gateway, *self.decoders.values(), *self.encoders]:
            if s is not None:
                s.stop()
        for proxy in self.proxies:
            proxy.stop()


# --- the load ----------------------------------------------------------------------------------------

@dataclass
class Record:
    """One request as the client saw it, retries included."""

    kind: str
    stream: bool
    n: int
    start: float                 # seconds since the load began
    outcome: str = ""            # completed, lost, or cut (a stream a decoder_kill cut: cut_by_kill)
    detail: str = ""
    retries: int = 0             # retriable statuses (429/503 before streaming) answered first
    ttft: float | None = None    # streamed requests: to the first content
    e2e: float | None = None
    ended_at: float | None = None  # monotonic, when it ended (a stream cut by a decoder_kill: near the kill)


@dataclass
class LoadState:
    rng: random.Random
    hot: list[bytes]
    clips: list[bytes]
    sides: list[int]
    flood_images: list[bytes] = field(default_factory=list)
    flood: bool = False
    fresh_seed: int = 10_000
    records: list[Record] = field(default_factory=list)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def make_body(state: LoadState, args: argparse.Namespace) -> tuple[str, dict]:
    """A random chat request: (kind, body)."""
    rng = state.rng
    roll = rng.random()
    if state.flood:
        kind = "image"
    elif roll < args.text_fraction:
        kind = "text"
    elif roll < args.text_fraction + args.video_fraction and state.clips:
        kind = "video"
    else:
        kind = "image"
    content: list[dict] = []
    if kind == "image":
        if state.flood and state.flood_images:  # large and distinct: the caches fill and evict
            image = state.flood_images.pop()
        elif state.flood or rng.random() < 0.3:  # a fresh image
            state.fresh_seed += 1
            side = rng.choice(state.sides)
            image = noise_image(state.fresh_seed, side, side)
        else:
            image = rng.choice(state.hot)
        content.append({"type": "image_url", "image_url": {"url": data_url("image/png", image)}})
    elif kind == "video":
        clip = data_url("video/mp4", rng.choice(state.clips))
        content.append({"type": "video_url", "video_url": {"url": clip}})
    text = rng.choice(["Describe this.", "What is shown?", "Say something."])
    content.append({"type": "text", "text": text})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": rng.random() < args.stream_fraction,
            "n": 2 if rng.random() < args.n2_fraction else 1}
    return kind, body


async def attempt(client: httpx.AsyncClient, body: dict, rec: Record, t0: float) -> tuple[int, float | None]:
    """One HTTP attempt: (status, Retry-After) of a refusal before streaming, or (200, None) once the
    record is complete or lost."""
    url = "/v1/chat/completions"
    if not body["stream"]:
        reply = await client.post(url, json=body)
        if reply.status_code in RETRIABLE_STATUSES:
            return reply.status_code, float(reply.headers.get("retry-after", 1))
        if reply.status_code != 200:
            rec.outcome, rec.detail = "lost", f"status {reply.status_code}: {reply.text[:200]}"
            return reply.status_code, None
        choices = reply.json().get("choices", [])
        ok = len(choices) == body["n"] and all(c.get("finish_reason") for c in choices)
        rec.outcome, rec.detail = ("completed", "") if ok else ("lost", "incomplete choices")
        rec.e2e = time.monotonic() - t0
        return 200, None
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code in RETRIABLE_STATUSES:
            await reply.aread()
            return reply.status_code, float(reply.headers.get("retry-after", 1))
        if reply.status_code != 200:
            rec.outcome, rec.detail = "lost", f"status {reply.status_code}: {(await reply.aread())[:200]!r}"
            return reply.status_code, None
        finished, done = set(), False
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                rec.outcome, rec.detail = "lost", f"error after streaming began: {event['error']}"
                return 200, None
            for choice in event.get("choices", []):
                if rec.ttft is None and choice.get("delta", {}).get("content"):
                    rec.ttft = time.monotonic() - t0
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
        rec.e2e = time.monotonic() - t0
        ok = done and len(finished) == body["n"]
        rec.outcome, rec.detail = ("completed", "") if ok else ("lost", "stream ended early")
        return 200, None


async def one_request(client: httpx.AsyncClient, state: LoadState, args: argparse.Namespace,
                      load_t0: float) -> None:
    kind, body = make_body(state, args)
    t0 = time.monotonic()
    rec = Record(kind, body["stream"], body["n"], t0 - load_t0)
    state.records.append(rec)
    for _ in range(args.max_retries + 1):
        try:
            status, retry_after = await attempt(client, body, rec, t0)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.outcome, rec.detail = "lost", f"{type(exc).__name__}: {exc}"
            rec.ended_at = time.monotonic()
            return
        if retry_after is None:
            rec.ended_at = time.monotonic()
            return
        rec.retries += 1
        await asyncio.sleep(random.uniform(0.5, 1.0) * min(retry_after, args.retry_cap))
    rec.outcome, rec.detail = "lost", f"still refused after {args.max_retries} retries"


async def run_load(gateway: str, state: LoadState, args: argparse.Namespace, stop: asyncio.Event,
                   load_t0: float) -> None:
    """Open-loop arrivals until stop is set, then wait for every request in flight."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://{gateway}", timeout=args.request_timeout,
                                 limits=limits) as client:
        tasks: set[asyncio.Task] = set()
        while not stop.is_set():
            task = asyncio.create_task(one_request(client, state, args, load_t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            rate = args.flood_rate if state.flood else args.rate
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), state.rng.expovariate(rate))
        if tasks:
            await asyncio.wait(tasks, timeout=args.request_timeout + 30)


# --- the faults --------------------------------------------------------------------------------------

def health_status(address: str) -> str:
    """The service's overall health status, or UNREACHABLE."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def identities(pids: list[int]) -> set[tuple[int, int]]:
    """(pid, start time) of each: a pid the system hands to another process later is not ours."""
    out = set()
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            out.add((pid, int(fields[19])))
    return out


def alive_pids(ours: set[tuple[int, int]]) -> list[int]:
    """The pids of ours that still run (zombies are not counted: they hold nothing but a table entry)."""
    out = []
    for pid, started in ours:
        fields = _stat(pid)
        if fields is not None and int(fields[19]) == started and fields[0] != "Z":
            out.append(pid)
    return sorted(out)


async def encoder_kill(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    enc = fleet.encoders[0]
    children = identities(process_tree(enc.proc.pid)[1:])  # they must die with it (they hold its memory)
    t0 = time.monotonic()
    enc.proc.kill()
    enc.proc.wait()
    await asyncio.sleep(args.restart_after)
    left = alive_pids(children)
    enc.launch()
    await asyncio.to_thread(enc.wait, args.start_timeout)
    fleet.note_pids()
    return {"killed": enc.name, "children": len(children), "children_alive_after_kill": left,
            "healthy_again_s": round(time.monotonic() - t0, 2)}


async def decoder_drain(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    old = next(iter(fleet.decoders.values()))
    fresh = fleet.new_decoder()
    t0 = time.monotonic()
    old.proc.send_signal(signal.SIGTERM)
    fresh.launch()
    not_serving_at = None
    while old.proc.poll() is None:  # health must say NOT_SERVING while the process still runs
        status = await asyncio.to_thread(health_status, old.address)
        if status == "NOT_SERVING" and not_serving_at is None:
            not_serving_at = time.monotonic() - t0
        await asyncio.sleep(0.2)
    exit_s, code = time.monotonic() - t0, old.proc.returncode
    del fleet.decoders[old.name]
    fleet.write_listing()
    await asyncio.to_thread(fresh.wait, args.start_timeout)
    fleet.decoders[fresh.name] = fresh
    fleet.write_listing()
    healthy_s = time.monotonic() - t0
    fleet.note_pids()
    old.proc = None
    return {"drained": old.name, "replacement": fresh.name, "exit_s": round(exit_s, 2), "exit_code": code,
            "not_serving_before_exit": not_serving_at is not None,
            "not_serving_after_s": None if not_serving_at is None else round(not_serving_at, 2),
            "replacement_listed_s": round(healthy_s, 2),
            "exit_within_drain_timeout_plus_2s": exit_s <= args.drain_timeout + 2}


async def encoder_stall(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    enc = fleet.encoders[1]
    enc.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(args.stall_seconds)
    finally:
        enc.proc.send_signal(signal.SIGCONT)
    return {"stalled": enc.name, "seconds": args.stall_seconds}


async def link_faults(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    proxy = fleet.proxies[1]
    out = {}
    try:
        proxy.delay_s, proxy.mode = args.link_delay, "delay"
        await asyncio.sleep(args.link_fault_seconds)
        proxy.mode = "pass"
        out["reset_connections"] = proxy.reset_all()
        await asyncio.sleep(args.link_fault_seconds)
        proxy.mode = "blackhole"
        await asyncio.sleep(args.link_fault_seconds)
    finally:
        proxy.mode = "pass"
    return out


async def cache_flood(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    before = [await asyncio.to_thread(encoder_stats, e.address) for e in fleet.encoders]
    state.flood = True
    try:
        await asyncio.sleep(args.flood_seconds)
    finally:
        state.flood = False
    # Its evictions are counted once the run is over (books()): the flood's requests queue past its end.
    return {"evictions_before": sum(b["evictions"] for b in before),
            "cache_bytes_capacity": [b["cache_bytes_capacity"] for b in before]}


async def decoder_kill(fleet: Fleet, state: LoadState, args: argparse.Namespace) -> dict:
    old = next(iter(fleet.decoders.values()))
    children = identities(process_tree(old.proc.pid)[1:])  # its engine core: it must follow the front end
    fresh = fleet.new_decoder()
    # Killed with requests on it (the load is light): up to --kill-wait-seconds for running or waiting ones.
    busy, deadline = {}, time.monotonic() + args.kill_wait_seconds
    while time.monotonic() < deadline:
        busy = await asyncio.to_thread(decoder_stats, old.address)
        if busy.get("running", 0) + busy.get("waiting", 0) > 0:
            break
        await asyncio.sleep(0.05)
    retries_before = await asyncio.to_thread(gateway_retries, fleet.gateway.address)
    killed_at = time.monotonic()
    old.proc.kill()
    old.proc.wait()
    del fleet.decoders[old.name]
    fleet.write_listing()  # as an orchestrator would: the gateway stops sending there at its next look
    fresh.launch()
    await asyncio.to_thread(fresh.wait, args.start_timeout)
    fleet.decoders[fresh.name] = fresh
    fleet.write_listing()
    left = await asyncio.to_thread(_alive_after, children, 10.0)
    retries_after = await asyncio.to_thread(gateway_retries, fleet.gateway.address)
    fleet.note_pids()
    old.proc = None
    return {"killed": old.name, "replacement": fresh.name, "killed_at": killed_at,
            "requests_on_it": busy.get("running", 0) + busy.get("waiting", 0),
            # requests the gateway sent to the other decoder meanwhile, nothing of them sent yet
            "gateway_restarts": retries_after["restart"] - retries_before["restart"],
            "gateway_failovers": retries_after["failover"] - retries_before["failover"],
            "children": len(children), "children_alive_after_kill": left,
            "replacement_listed_s": round(time.monotonic() - killed_at, 2)}


def gateway_retries(address: str) -> dict[str, int]:
    """The gateway's count of requests it sent to another decoder before anything reached the client, by
    kind (failover: refused before its first message; restart: its decoder went away)."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    out = {"failover": 0, "restart": 0}
    for family in text_string_to_metric_families(text):
        if family.name == "mmserve_gateway_decoder_retries":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["kind"]] = int(sample.value)
    return out


def _alive_after(ours: set[tuple[int, int]], timeout: float) -> list[int]:
    """Those of our processes still alive once timeout has passed or none is (an engine core notices its
    front end's death on its pipe and exits by itself)."""
    deadline = time.monotonic() + timeout
    while (left := alive_pids(ours)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def cut_by_kill(records: list[Record], faults: dict[str, dict]) -> int:
    """Mark the streams a decoder_kill cut (an error after streaming began, or a stream that ended early,
    within KILL_CUT_WINDOW_S of the kill) as "cut"; returns how many."""
    kill = faults.get("decoder_kill")
    if kill is None:
        return 0
    cut = 0
    for r in records:
        began = r.detail.startswith(_CUT_STREAM_ENDS)
        if (r.outcome == "lost" and r.stream and began and r.ended_at is not None
                and kill["killed_at"] <= r.ended_at <= kill["killed_at"] + KILL_CUT_WINDOW_S):
            r.outcome = "cut"
            cut += 1
    return cut


FAULT_RUNNERS = {"encoder_kill": encoder_kill, "decoder_drain": decoder_drain, "encoder_stall": encoder_stall,
                 "link_faults": link_faults, "cache_flood": cache_flood, "decoder_kill": decoder_kill}


# --- after the run -----------------------------------------------------------------------------------

def books(fleet: Fleet) -> dict:
    """Every surviving service's stats and the leak checks on them."""
    out, checks = {}, {}
    for s in fleet.encoders:
        st = encoder_stats(s.address)
        out[s.name] = {k: st[k] for k in ("active_leases", "leased_bytes", "entries", "evictions",
                                          "expired_leases")}
        checks.update({f"{s.name}_{k}": v for k, v in leak_checks({"running": 0, "waiting": 0,
                                                                 "kv_blocks_used": 0, "active_leases": 0},
                                                                st).items() if k.startswith("encoder")})
    for s in fleet.decoders.values():
        st = decoder_stats(s.address)
        out[s.name] = {k: st[k] for k in ("running", "waiting", "kv_blocks_used", "active_leases",
                                          "requests_finished", "requests_failed")}
        checks.update({f"{s.name}_{k}": v for k, v in leak_checks(st, {"active_leases": 0,
                                                                     "leased_bytes": 0}).items()
                       if k.startswith("decoder")})
    return {"stats": out, "checks": checks}


def stale_maps(fleet: Fleet) -> dict[str, int]:
    """Per surviving decoder (its processes together): mappings of shm segments that were unlinked, i.e.
    a dead encoder's arena still mapped. A restarted encoder's decoders must let go of the old one."""
    out = {}
    for s in fleet.decoders.values():
        if s.proc is None or s.proc.poll() is not None:
            continue
        count = 0
        for pid in process_tree(s.proc.pid):
            try:
                lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:
                continue
            count += len({line.split()[-2] for line in lines
                          if SHM_PREFIX in line and line.endswith("(deleted)")})
        out[s.name] = count
    return out


async def wait_clean(fleet: Fleet, timeout: float) -> dict:
    t0 = time.monotonic()
    while True:
        result = await asyncio.to_thread(books, fleet)
        result["stale_shm_maps"] = stale_maps(fleet)
        result["checks"].update({f"{name}_stale_shm_maps_0": n == 0
                                 for name, n in result["stale_shm_maps"].items()})
        if all(result["checks"].values()) or time.monotonic() - t0 > timeout:
            result["waited_s"] = round(time.monotonic() - t0, 2)
            return result
        await asyncio.sleep(0.5)


def memory(fleet: Fleet) -> dict:
    out = {}
    for s in fleet.services():
        if s.proc is not None and s.proc.poll() is None:
            out[s.name] = round(sum(rss_mib(p)["rss"] for p in process_tree(s.proc.pid)), 1)
    return out


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def ownerless(names: set[str]) -> list[str]:
    """The segments no live producer holds (its flock is free): left behind. A segment of another
    program's live encoder on this host is held, and not counted."""
    out = []
    for name in sorted(names):
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return out


def window_summary(records: list[Record], windows: list[dict]) -> dict:
    """TTFT of streamed requests (and E2E of all) that started in steady load (before the first fault)
    and in each fault's window (the fault and the steady load after it)."""
    def inside(r: Record, w: dict) -> bool:
        return w["start"] <= r.start < w["end"]

    def summary(rs: list[Record]) -> dict:
        done = [r for r in rs if r.outcome == "completed"]
        return {"requests": len(rs), "completed": len(done), "retried": sum(r.retries > 0 for r in rs),
                "ttft": summarize([r.ttft for r in done if r.ttft is not None]),
                "e2e": summarize([r.e2e for r in done if r.e2e is not None])}

    first = min((w["start"] for w in windows), default=float("inf"))
    out = {"steady": summary([r for r in records if r.start < first])}
    for w in windows:
        out[w["name"]] = summary([r for r in records if inside(r, w)])
    return out


def counts(records: list[Record]) -> dict:
    lost = [r for r in records if r.outcome not in ("completed", "cut")]
    cut = sum(r.outcome == "cut" for r in records)
    return {"requests": len(records), "completed": len(records) - len(lost) - cut, "cut_by_kill": cut,
            "completed_first_try": sum(r.outcome == "completed" and not r.retries for r in records),
            "completed_after_retry": sum(r.outcome == "completed" and r.retries > 0 for r in records),
            "retriable_statuses_before_streaming": sum(r.retries for r in records),
            "lost": len(lost), "lost_details": sorted({r.detail for r in lost})[:10],
            "by_kind": {k: sum(r.kind == k for r in records) for k in ("image", "video", "text")},
            "streamed": sum(r.stream for r in records), "n2": sum(r.n == 2 for r in records)}


# --- the run -----------------------------------------------------------------------------------------

def selected_faults(spec: str) -> list[str]:
    names = list(FAULTS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise SystemExit(f"--faults: unknown {unknown}; choose from {', '.join(FAULTS)}")
    return names


def make_state(args: argparse.Namespace) -> LoadState:
    rng = random.Random(args.seed)
    sides = [int(s) for s in args.image_sides.split(",")]
    hot = [noise_image(args.seed * 1000 + i, rng.choice(sides), rng.choice(sides))
           for i in range(args.hot_images)]
    clips = []
    if args.video_fraction > 0:
        from bench.video_serve import make_clip

        clips = [make_clip(1.0, 4, 64, seed=7000 + i, codec="mpeg4") for i in range(2)]
    flood = []
    if "cache_flood" in selected_faults(args.faults):
        flood = [noise_image(50_000 + i, args.flood_image_side, args.flood_image_side)
                 for i in range(int(args.flood_rate * args.flood_seconds * 1.5) + 4)]
    return LoadState(rng, hot, clips, sides, flood)


async def chaos(fleet: Fleet, args: argparse.Namespace, result: dict) -> None:
    state = make_state(args)
    stop = asyncio.Event()
    load_t0 = time.monotonic()
    load = asyncio.create_task(run_load(fleet.gateway.address, state, args, stop, load_t0))
    windows: list[dict] = []
    faults: dict[str, dict] = {}
    try:
        await asyncio.sleep(args.steady_seconds)
        result["rss_after_warmup_mib"] = memory(fleet)
        for name in selected_faults(args.faults):
            start = time.monotonic() - load_t0
            faults[name] = await FAULT_RUNNERS[name](fleet, state, args)
            fleet.check_alive()
            # A fault's window runs on through the steady load after it: its retries, its backlog and the
            # recovery belong to it. "steady" is the load before the first fault.
            await asyncio.sleep(args.gap_seconds)
            windows.append({"name": name, "start": start, "end": time.monotonic() - load_t0})
    finally:
        stop.set()
        await load
    cut_by_kill(state.records, faults)
    for fault in faults.values():
        fault.pop("killed_at", None)  # a monotonic time: meaningless in the report
    result["faults"] = faults
    result["windows"] = [{k: round(v, 2) if isinstance(v, float) else v for k, v in w.items()}
                         for w in windows]
    result["counts"] = counts(state.records)
    result["latency"] = window_summary(state.records, windows)
    fleet.check_alive()
    result["books"] = await wait_clean(fleet, args.idle_timeout)
    result["leases_expired"] = sum(result["books"]["stats"][e.name]["expired_leases"] for e in fleet.encoders)
    flood = faults.get("cache_flood")
    if flood is not None:
        flood["evictions"] = sum(result["books"]["stats"][e.name]["evictions"] for e in fleet.encoders) \
            - flood["evictions_before"]
    result["rss_at_end_mib"] = memory(fleet)
    result["gateway_retries"] = await asyncio.to_thread(gateway_retries, fleet.gateway.address)
    fleet.note_pids()
    result["records_lost"] = [asdict(r) for r in state.records if r.outcome not in ("completed", "cut")][:20]


def checks_of(result: dict, args: argparse.Namespace) -> dict[str, bool]:
    c = result.get("counts", {})
    checks = {"requests_served": c.get("completed", 0) > 0, "none_lost": c.get("lost", 1) == 0,
              "books_clean": bool(result.get("books", {}).get("checks"))
              and all(result["books"]["checks"].values()),
              "no_service_died": not result.get("died"),
              "no_orphaned_processes": not result.get("orphaned_pids"),
              "no_orphaned_shm": not result.get("orphaned_shm_segments"),
              "no_error": "error" not in result}
    drain = result.get("faults", {}).get("decoder_drain")
    if drain is not None:
        checks["drain_exit_in_time"] = bool(drain["exit_within_drain_timeout_plus_2s"])
        checks["not_serving_before_exit"] = bool(drain["not_serving_before_exit"])
    kill = result.get("faults", {}).get("encoder_kill")
    if kill is not None:
        checks["killed_encoder_children_gone"] = not kill["children_alive_after_kill"]
    dkill = result.get("faults", {}).get("decoder_kill")
    if dkill is not None:
        checks["killed_decoder_core_gone"] = not dkill["children_alive_after_kill"]
    return checks


def print_summary(result: dict) -> None:
    c = result.get("counts", {})
    g = result.get("gateway_retries", {})
    print_table("requests", ["requests", "completed", "after retry", "retriable statuses", "cut by kill",
                             "lost", "gateway failovers", "gateway restarts"],
                [[c.get("requests"), c.get("completed"), c.get("completed_after_retry"),
                  c.get("retriable_statuses_before_streaming"), c.get("cut_by_kill"), c.get("lost"),
                  g.get("failover"), g.get("restart")]])
    rows = [[name, w["requests"], w["completed"], w["retried"], w["ttft"].get("p50_ms"),
             w["ttft"].get("p99_ms")] for name, w in result.get("latency", {}).items()]
    print_table("TTFT by window (streamed requests, ms)", ["window", "requests", "completed", "retried",
                                                           "p50", "p99"], rows)
    print_table("checks", ["check", "ok"], [[k, v] for k, v in result.get("checks", {}).items()])


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    selected_faults(args.faults)
    logs = workdir(args.logs)
    fleet = Fleet(args, logs)
    shm_before = shm_segments()
    result: dict = {"logs": str(logs)}
    try:
        fleet.start()
        asyncio.run(chaos(fleet, args, result))
    except Exception as exc:  # noqa: BLE001 - reported, and the services stopped below
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["died"] = list(fleet.died)
        fleet.stop()
    time.sleep(1.0)
    result["orphaned_pids"] = alive_pids(fleet.pids)
    result["orphaned_shm_segments"] = ownerless(shm_segments() - shm_before)
    result["checks"] = checks_of(result, args)
    save_result("chaos", args, clean(result))
    print_summary(result)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
