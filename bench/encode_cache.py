"""Encode on an embedding-cache miss vs a hit.

    python -m bench.encode_cache --model DIR [--device cuda --dtype bfloat16] [--out encode.json]
    python -m bench.encode_cache --encoder 127.0.0.1:50051

Miss: a new image (bytes) runs the vision tower. Hit by bytes: the same image again (decode + hash, no
tower). Hit by hash: only its content hash is sent. Each time includes importing the embedding onto
--device with the best transport both sides support, as the decoder does.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence

import torch

from bench.embeds import TRANSPORT_NAMES, encode_and_import, sync
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import encoder_service, workdir
from bench.stats import ratio, summarize
from bench.workload import random_png
from common.client import EncoderClient
from common.transport.importer import readable_transports


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the encode hit/miss benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.encode_cache", description=__doc__.split("\n")[0])
    p.add_argument("--encoder", default=None, help="a running encoder (otherwise one is spawned)")
    add_model_args(p)
    p.add_argument("--iters", type=int, default=16, help="images (misses), then as many hits of each kind")
    p.add_argument("--image-size", type=int, default=336, help="side of the random PNGs")
    p.add_argument("--seed", type=int, default=0, help="image seed: change it to miss on a warm encoder")
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None)
    return p


@contextlib.contextmanager
def encoder_address(args: argparse.Namespace) -> Iterator[str]:
    """--encoder, or a spawned encoder on the model (stopped afterwards)."""
    if args.encoder:
        yield args.encoder
        return
    svc = encoder_service(resolve_model(args), workdir(args.logs), args.device, args.dtype).start()
    try:
        yield svc.address
    finally:
        svc.stop()


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.zeros(1, device=device)
        sync(device)
    accept = readable_transports(device)
    images = [random_png(args.seed * 100_003 + 777 + i, args.image_size) for i in range(args.iters)]
    with encoder_address(args) as address, EncoderClient(address, timeout=300) as client:
        encode_and_import(client, random_png(args.seed + 1, args.image_size), accept, device)  # open arena
        misses = [encode_and_import(client, img, accept, device) for img in images]
        hits = [encode_and_import(client, img, accept, device) for img in images]
        by_hash = [encode_and_import(client, f"hash:{m.content_hash}", accept, device) for m in misses]
    kinds = {"miss": misses, "hit_bytes": hits, "hit_hash": by_hash}
    results = {k: summarize([r.total_s for r in v]) for k, v in kinds.items()}
    results["unexpected_cache_flags"] = (sum(r.cache_hit for r in misses)
                                         + sum(not r.cache_hit for r in hits + by_hash))
    results["transport"] = TRANSPORT_NAMES[misses[0].transport]
    results["nbytes"] = misses[0].nbytes
    results["miss_over_hit_p50"] = ratio(results["miss"]["p50_ms"], results["hit_bytes"]["p50_ms"])
    print_table(f"Encode on {device} ({results['transport']}), ms",
                ["case", "n", "mean", "p50", "p99"],
                [[k, results[k]["n"], results[k]["mean_ms"], results[k]["p50_ms"], results[k]["p99_ms"]]
                 for k in kinds])
    return save_result("encode_cache", args, results)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
