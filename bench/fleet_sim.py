"""Sizing the encoder pool for a decoder pool: a discrete-event simulation of a day of traffic (no processes).

    python -m bench.fleet_sim [--decoders 100] [--encoders 30] [--peak-rps 1200] [--sweep 6:30:2]
                              [--ttft-p99-ms 500] [--out sim.json]

Per-request costs are parameters whose defaults are this project's H100 measurements of Qwen3-VL-8B
(BENCHMARKS.md; `Costs` names the figure behind each). The trace: requests arrive as a Poisson process
whose rate follows the day (a sine with its peak, `--peak-rps`, at 16:00 and its trough at 04:00,
(1 - amplitude) / (1 + amplitude) of the peak); each is a new image (one 1024x1024 image + text), a
text-only request, or a follow-up turn about an earlier image. What is modelled:

- Gateway: a follow-up goes to the decoder holding its conversation with probability `--prefix-hit`
  (cache-aware routing's measured hit rate) and then prefills warm, with no Encode; every other request
  goes to the decoder with the fewest requests open (least-outstanding).
- Encoders: an image is owned by one encoder by its content hash (uniform over the pool, whatever the
  load: the ring does not balance by queue). A cached embedding (`--encoder-hit`, and a follow-up's
  image) is answered without the tower; a miss waits for the tower, which takes up to `encode_max_batch`
  queued images at a time.
- Decoders: one prefill at a time in arrival order, each carried by a step beside the running sequences;
  a sequence then decodes its output tokens at the step time of the batch it joined, holding one of
  `max_running` slots (a request waits for a slot before its prefill).

A whole day at a fleet's rate is tens of millions of requests; the default simulates each of
`--slots` equal parts of the day for `--slot-seconds` of its traffic, one after the other (the queues
carry over), so the sample holds each hour in proportion to its traffic. `--slot-seconds 3600 --slots 24`
simulates every request of the day (docs/kubernetes.md says what that costs). TTFT here is the serving
path's (encode wait + Encode + prefill wait + prefill); the gateway's own time and the network are
outside it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from dataclasses import asdict, dataclass, field

from bench.stats import percentile

DAY_S = 86400.0


@dataclass(frozen=True)
class Costs:
    """Per-request costs, milliseconds unless named otherwise (defaults: H100, Qwen3-VL-8B, BENCHMARKS.md)."""

    # Encode, 64 clients, 192 images: 60.0 img/s (V2, 2026-12-06 call 3): the tower's steady cost an image.
    encode_ms_per_image: float = 1000.0 / 60.0
    # Encode, 1 client: 57.4 img/s (V2): what an image alone pays over the steady rate, once per batch.
    encode_batch_fixed_ms: float = 1000.0 / 57.4 - 1000.0 / 60.0
    # The tower's batch in V2's 64-client run ("our tower, batch 8": 73.8 img/s).
    encode_max_batch: int = 8
    # An Encode answered from the cache, handoff included: NIXL VRAM to VRAM, 1.52 ms p50
    # (docs/benchmarks/history.md, "The handoff of a cache hit").
    encode_hit_ms: float = 1.52
    # TTFT warm, p50: 16.5 ms (T4, 2026-12-06 call 4): a request whose prefix is cached, floor of any prefill.
    prefill_base_ms: float = 16.5
    # TTFT cold, 1538 prompt tokens, p50: 72.7 ms (T4), less its Encode (1 client p50 14.1 ms, V2) and the
    # base: (72.7 - 14.1 - 16.5) / 1538 tokens.
    prefill_ms_per_token: float = (72.7 - 14.1 - 16.5) / 1538
    # Decode, bf16, through gRPC: 237.7 tok/s at batch 1 and 5791 tok/s at 32 streams (Q1, H200,
    # 2026-12-05: not measured on H100): a step's time, interpolated linearly in the batch.
    step_ms_batch1: float = 1000.0 / 237.7
    step_ms_batch32: float = 32 * 1000.0 / 5791
    max_running: int = 64  # sequences a decoder runs at once (the batch the KV cache is sized for)

    def step_ms(self, running: int) -> float:
        """A decode step's time with `running` sequences (at least one)."""
        return self.step_ms_batch1 + (self.step_ms_batch32 - self.step_ms_batch1) * (max(running, 1) - 1) / 31

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_ms_per_token * tokens


@dataclass(frozen=True)
class Mix:
    """What the requests are."""

    image_share: float = 0.5     # a new image (1024x1024: 1024 tokens) + text
    followup_share: float = 0.2  # another turn about an earlier image; the rest: text only
    prefix_hit: float = 0.75     # cache-aware routing's hit rate (docs/kubernetes.md: 0.70-0.78 measured)
    encoder_hit: float = 0.1     # a "new" image the encoders already hold (a popular image)
    image_tokens: int = 1024     # a 1024x1024 image, Qwen3-VL (TTFT workload: 1538 tokens with its text)
    text_tokens: int = 514
    followup_tokens: int = 120   # the new turn's tokens, prefilled on a hit
    history_tokens: int = 300    # the earlier turns' text, prefilled again on a miss
    output_tokens: float = 200.0  # mean (exponential)


@dataclass(frozen=True)
class Trace:
    peak_rps: float = 1200.0
    amplitude: float = 0.3       # rate = peak x (1 + amplitude x sin) / (1 + amplitude): trough/peak = 0.54
    slots: int = 24
    slot_seconds: float = 10.0
    seed: int = 0

    def rate(self, day_s: float) -> float:
        """Requests a second at that second of the day (peak at 16:00, trough at 04:00)."""
        return self.peak_rps * (1 + self.amplitude * math.sin(2 * math.pi * (day_s - 10 * 3600) / DAY_S)) \
            / (1 + self.amplitude)


@dataclass
class Request:
    kind: str                    # image, text, followup_hit, followup_miss
    arrival: float
    tokens: int
    output: int
    image_u: float | None        # the image's hash as a number in [0, 1): its encoder; None: no Encode
    tower: bool                  # the Encode runs the tower (a miss)
    decoder: int = -1
    encode_queued: float = 0.0
    encode_wait: float = 0.0
    encode_done: float = 0.0
    ttft: float = 0.0


def make_trace(trace: Trace, mix: Mix) -> list[Request]:
    """The sampled day's requests in arrival order (the same for every pool size on one seed)."""
    rng = random.Random(trace.seed)
    out, t = [], 0.0
    for slot in range(trace.slots):
        rate = trace.rate((slot + 0.5) * DAY_S / trace.slots)
        end = (slot + 1) * trace.slot_seconds
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            roll, output = rng.random(), max(1, round(rng.expovariate(1 / mix.output_tokens)))
            if roll < mix.image_share:
                out.append(Request("image", t, mix.image_tokens + mix.text_tokens, output, rng.random(),
                                   rng.random() >= mix.encoder_hit))
            elif roll < mix.image_share + mix.followup_share:
                if rng.random() < mix.prefix_hit:
                    out.append(Request("followup_hit", t, mix.followup_tokens, output, None, False))
                else:  # the image comes again from its encoder's cache, the whole conversation prefills
                    tokens = mix.image_tokens + mix.text_tokens + mix.history_tokens + mix.followup_tokens
                    out.append(Request("followup_miss", t, tokens, output, rng.random(), False))
            else:
                out.append(Request("text", t, mix.text_tokens, output, None, False))
    return out


@dataclass
class Pool:
    """Busy time of a pool's members within [0, horizon] (the trace; not the queues' drain after it)."""

    size: int
    horizon: float
    busy_s: float = 0.0
    since: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.since = [-1.0] * self.size

    def start(self, i: int, now: float) -> None:
        if self.since[i] < 0:
            self.since[i] = now

    def stop(self, i: int, now: float) -> None:
        if self.since[i] >= 0:
            self.busy_s += max(0.0, min(now, self.horizon) - self.since[i])
            self.since[i] = -1.0

    def utilisation(self) -> float:
        """Busy time / (members x horizon)."""
        busy = self.busy_s + sum(max(0.0, self.horizon - s) for s in self.since if s >= 0)
        return busy / (self.size * self.horizon) if self.horizon > 0 else 0.0


def simulate(requests: list[Request], decoders: int, encoders: int, costs: Costs,
             prefix_seed: int = 0, horizon: float | None = None) -> dict:
    """Run the requests through the pools; the figures (times in ms; utilisation and mean running over
    [0, horizon], by default until the last arrival). `requests` are updated in place."""
    rng = random.Random(prefix_seed)  # which decoder holds a hit follow-up's conversation
    events: list[tuple[float, int, int, object]] = []  # (time, order, kind, payload)
    order = 0

    def at(time: float, kind: int, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (time, order, kind, payload))

    ARRIVE, ENCODED, TOWER_FREE, PREFILLED, FINISHED = range(5)
    enc_queue: list[list[Request]] = [[] for _ in range(encoders)]
    enc_busy = [False] * encoders
    dec_queue: list[list[Request]] = [[] for _ in range(decoders)]
    dec_prefilling = [False] * decoders
    running = [0] * decoders
    running_area, last_change = [0.0] * decoders, [0.0] * decoders  # sequence-seconds, for the mean
    outstanding = [0] * decoders
    horizon = horizon or (requests[-1].arrival if requests else 0.0)
    enc_pool, dec_pool = Pool(encoders, horizon), Pool(decoders, horizon)
    batches = 0
    for r in requests:
        at(r.arrival, ARRIVE, r)

    def start_tower(e: int, now: float) -> None:
        nonlocal batches
        batch = enc_queue[e][:costs.encode_max_batch]
        del enc_queue[e][:len(batch)]
        for r in batch:
            r.encode_wait = now - r.encode_queued
        enc_busy[e] = True
        enc_pool.start(e, now)
        batches += 1
        done = now + (costs.encode_batch_fixed_ms + costs.encode_ms_per_image * len(batch)) / 1000
        at(done, TOWER_FREE, (e, batch))

    def try_prefill(d: int, now: float) -> None:
        if dec_prefilling[d] or not dec_queue[d] or running[d] >= costs.max_running:
            return
        r = dec_queue[d].pop(0)
        dec_prefilling[d] = True
        dec_pool.start(d, now)
        at(now + (costs.prefill_ms(r.tokens) + costs.step_ms(running[d] + 1)) / 1000, PREFILLED, r)

    def add_running(d: int, now: float, delta: int) -> None:
        running_area[d] += running[d] * max(0.0, min(now, horizon) - last_change[d])
        last_change[d] = min(now, horizon)
        running[d] += delta

    def ready(r: Request, now: float) -> None:  # the embedding (if any) is on the decoder
        r.encode_done = now
        dec_queue[r.decoder].append(r)
        try_prefill(r.decoder, now)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVE:
            r = payload
            if r.kind == "followup_hit":
                r.decoder = rng.randrange(decoders)
            else:
                r.decoder = outstanding.index(min(outstanding))
            outstanding[r.decoder] += 1
            if r.image_u is None:
                ready(r, now)
            elif not r.tower:
                at(now + costs.encode_hit_ms / 1000, ENCODED, r)
            else:
                e = int(r.image_u * encoders)
                r.encode_queued = now
                enc_queue[e].append(r)
                if not enc_busy[e]:
                    start_tower(e, now)
        elif kind == ENCODED:
            ready(payload, now)
        elif kind == TOWER_FREE:
            e, batch = payload
            enc_busy[e] = False
            for r in batch:
                ready(r, now)
            if enc_queue[e]:
                start_tower(e, now)
            else:
                enc_pool.stop(e, now)
        elif kind == PREFILLED:
            r = payload
            d = r.decoder
            r.ttft = now - r.arrival
            dec_prefilling[d] = False
            dec_pool.stop(d, now)
            add_running(d, now, 1)
            at(now + r.output * costs.step_ms(running[d]) / 1000, FINISHED, r)
            try_prefill(d, now)
        elif kind == FINISHED:
            d = payload.decoder
            add_running(d, now, -1)
            outstanding[d] -= 1
            try_prefill(d, now)
    mean_running = sum(running_area) / (decoders * horizon) if horizon > 0 else 0.0
    return summarize(requests, decoders, encoders, enc_pool.utilisation(), dec_pool.utilisation(),
                     mean_running, batches)


def summarize(requests: list[Request], decoders: int, encoders: int, enc_util: float, prefill_util: float,
              mean_running: float, batches: int) -> dict:
    ms = 1000.0
    towered = [r for r in requests if r.tower]
    encode = [(r.encode_done - r.arrival) * ms for r in towered]
    ttft = [r.ttft * ms for r in requests]
    prefill_wait = [(r.arrival + r.ttft - r.encode_done) * ms for r in requests]
    by_kind = {k: [r.ttft * ms for r in requests if r.kind == k]
               for k in ("image", "text", "followup_hit", "followup_miss")}
    return {
        "decoders": decoders, "encoders": encoders, "requests": len(requests), "tower_images": len(towered),
        "tower_batches": batches, "encoder_utilisation": round(enc_util, 3),
        "decoder_prefill_utilisation": round(prefill_util, 3),
        "decoder_mean_running": round(mean_running, 2),
        "encode_queue_ms": pcts([r.encode_wait * ms for r in towered]),
        "encode_ms": pcts(encode),
        "prefill_wait_plus_prefill_ms": pcts(prefill_wait),
        "ttft_ms": pcts(ttft),
        "ttft_by_kind_ms": {k: pcts(v) for k, v in by_kind.items() if v},
    }


def pcts(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 1), "p99": round(percentile(values, 99), 1)}


def run(decoders: int, encoders: int, trace: Trace, mix: Mix, costs: Costs) -> dict:
    """One pool size on the trace (generated afresh: the same for every size on one seed)."""
    return simulate(make_trace(trace, mix), decoders, encoders, costs, trace.seed,
                    horizon=trace.slots * trace.slot_seconds)


def smallest_encoders(results: list[dict], ttft_p99_ms: float) -> int | None:
    """The fewest encoders of a sweep from which on every larger count kept TTFT p99 under the target."""
    best = None
    for res in sorted(results, key=lambda r: r["encoders"], reverse=True):
        if res["ttft_ms"]["p99"] > ttft_p99_ms:
            break
        best = res["encoders"]
    return best


def table(results: list[dict]) -> str:
    """The sweep as a Markdown table."""
    lines = ["| encoders | encoder util | decoder prefill util / running | Encode queue p50 / p99 ms "
             "| Encode p99 ms | TTFT p50 / p99 ms | image TTFT p99 ms |", "| --- " * 7 + "|"]
    for r in results:
        lines.append(
            f"| {r['encoders']} | {r['encoder_utilisation']:.2f} | {r['decoder_prefill_utilisation']:.2f} / "
            f"{r['decoder_mean_running']:.1f} | {r['encode_queue_ms']['p50']} / "
            f"{r['encode_queue_ms']['p99']} | {r['encode_ms']['p99']} | {r['ttft_ms']['p50']} / "
            f"{r['ttft_ms']['p99']} | {r['ttft_by_kind_ms']['image']['p99']} |")
    return "\n".join(lines)


def parse_sweep(text: str) -> list[int]:
    """"6:30:2" (from, to inclusive, step) or "8,12,30"."""
    if ":" in text:
        lo, hi, step = (int(x) for x in text.split(":"))
        return list(range(lo, hi + 1, step))
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decoders", type=int, default=100)
    p.add_argument("--encoders", type=int, default=30)
    p.add_argument("--sweep", help="encoder counts, e.g. 6:30:2 or 8,12,30 (instead of --encoders)")
    p.add_argument("--ttft-p99-ms", type=float, default=500.0, help="the target the sweep sizes for")
    p.add_argument("--peak-rps", type=float, default=Trace.peak_rps)
    p.add_argument("--amplitude", type=float, default=Trace.amplitude)
    p.add_argument("--slots", type=int, default=Trace.slots)
    p.add_argument("--slot-seconds", type=float, default=Trace.slot_seconds)
    p.add_argument("--seed", type=int, default=0)
    for name, value in asdict(Mix()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--out")
    args = p.parse_args(argv)
    trace = Trace(args.peak_rps, args.amplitude, args.slots, args.slot_seconds, args.seed)
    mix = Mix(**{k: getattr(args, k) for k in asdict(Mix())})
    costs = Costs()
    counts = parse_sweep(args.sweep) if args.sweep else [args.encoders]
    results = [run(args.decoders, e, trace, mix, costs) for e in counts]
    report = {"trace": asdict(trace), "mix": asdict(mix), "costs": asdict(costs), "results": results,
              "ttft_p99_target_ms": args.ttft_p99_ms,
              "smallest_encoders": smallest_encoders(results, args.ttft_p99_ms)}
    print(table(results))
    print(f"{args.decoders} decoders, {results[0]['requests']} requests sampled: the smallest encoder count "
          f"with TTFT p99 <= {args.ttft_p99_ms:g} ms: {report['smallest_encoders']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
