"""Lookahead on vs off under load: decoder `--encoder-max-ahead 4` vs `0`, same encoder, same requests.

    python -m bench.lookahead --model DIR [--device cuda --dtype bfloat16] [--out lookahead.json]
    python -m bench.lookahead --encoder E --addr-on D4 [--addr-off D0] --model DIR

Every request has its own image, all sent at once, so a queue forms and the encoder has work to do
ahead of prefill. The two runs use different cache salts: both miss the encoder cache on every image.
Services not given by address are spawned together: the encoder, and decoders with a small
--max-num-seqs so that requests queue (lookahead only acts on queued requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
from collections.abc import Iterator, Sequence

from bench.loadgen import LoadConfig
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.serve import measure
from bench.services import Service, decoder_service, encoder_service, start_all, workdir
from bench.stats import ratio
from bench.workload import PromptMaker, build_requests

SETTINGS = {"on": 4, "off": 0}


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the lookahead benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.lookahead", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--encoder", default=None, help="a running encoder")
    p.add_argument("--addr-on", default=None, help="a running decoder with --encoder-max-ahead 4")
    p.add_argument("--addr-off", default=None, help="a running decoder with --encoder-max-ahead 0")
    p.add_argument("--max-ahead", type=int, default=SETTINGS["on"], help="spawned on-decoder lookahead")
    p.add_argument("--decoder-args", default="", help="extra flags for spawned decoders")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="running requests of spawned decoders: small, so that a queue forms")
    p.add_argument("--encoder-args", default="", help="extra flags for a spawned encoder")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


@contextlib.contextmanager
def started(services: list[Service]) -> Iterator[None]:
    """Start the services together; stop them afterwards."""
    start_all(services)
    try:
        yield
    finally:
        for svc in reversed(services):
            svc.stop()


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    needs_model = not (args.encoder and args.addr_on and args.addr_off)
    model = resolve_model(args) if (needs_model or args.model) else None  # also calibrates prompts
    logs = workdir(args.logs)
    prompts = PromptMaker(model, seed=args.seed)
    requests = build_requests(args.num_requests, 0.0, args.prompt_len, prompts, args.image_size,
                              seed=args.seed)
    ahead = {"on": args.max_ahead, "off": SETTINGS["off"]}
    addrs = {"on": args.addr_on, "off": args.addr_off, "encoder": args.encoder}
    spawn: list[Service] = []
    if not addrs["encoder"]:
        svc = encoder_service(model, logs, args.device, args.dtype, shlex.split(args.encoder_args))
        spawn.append(svc)
        addrs["encoder"] = svc.address
    for name in ("off", "on"):
        if not addrs[name]:
            extra = [*shlex.split(args.decoder_args), "--max-num-seqs", str(args.max_num_seqs),
                     "--encoder-max-ahead", str(ahead[name])]
            svc = decoder_service(model, addrs["encoder"], logs, args.device, args.dtype, extra,
                                  name=f"decoder-{name}")
            spawn.append(svc)
            addrs[name] = svc.address
    runs: dict[str, dict] = {}
    with started(spawn):
        for name in ("off", "on"):
            cfg = LoadConfig(concurrency=args.concurrency, output_len=args.output_len,
                             cache_salt=f"lookahead-{name}-{args.seed}")
            runs[name], _ = asyncio.run(measure(addrs[name], addrs["encoder"], requests, cfg, (),
                                                args.progress, desc=f"lookahead {name}"))
    on, off = runs["on"], runs["off"]
    results = {**runs, "on_over_off_output_tps": ratio(on["output_token_throughput_tps"] or 0.0,
                                                        off["output_token_throughput_tps"] or 0.0),
               "on_over_off_ttft_mean": ratio(on["ttft"]["mean_ms"], off["ttft"]["mean_ms"]),
               "on_over_off_e2e_mean": ratio(on["e2e"]["mean_ms"], off["e2e"]["mean_ms"])}
    rows = [[f"lookahead {n}", r["output_token_throughput_tps"], r["ttft"]["mean_ms"], r["ttft"]["p99_ms"],
             r["e2e"]["mean_ms"], r["cache"].get("images_prefetched"),
             r["cache"].get("lookahead_ready_at_prefill")] for n, r in runs.items()]
    print_table("lookahead on vs off", ["run", "output tok/s", "TTFT mean", "TTFT p99", "E2E mean",
                                        "prefetched", "ready at prefill"], rows)
    return save_result("lookahead", args, results)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    payload = run(build_arg_parser().parse_args(argv))
    return 1 if any(payload["results"][n]["failed"] for n in SETTINGS) else 0


if __name__ == "__main__":
    raise SystemExit(main())
