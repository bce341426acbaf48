"""The prefix lookup's block hashing on a CPU: microseconds per block, before and after issue 65.

    python -m bench.block_hash [--blocks 482] [--repeats 200] [--out block_hash.json]

"pickle": the hashing the block manager used before issue 65 (each block's (parent, token tuple, extra
keys) pickled, then sha256), copied here as the baseline. "packed": decoder_svc/engine/block_hashing.py
(the tokens packed once as int64, one sha256 over a framed buffer per block). Both hash every full block
of one request: a Qwen-shaped prompt whose image covers most blocks (a 30 s video's 7800 tokens are 482
blocks of 16), as the lookup of a warm request does. The two run interleaved; the minimum over repeats
is reported, since other work on the host only adds time.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import time
from collections.abc import Callable, Sequence

from bench.report import print_table, save_result
from decoder_svc.engine.block_hashing import extend_block_hashes
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
_OLD_ROOT = b"mmserve.kv.v1"


def pickle_hashes(request: Request, n_full: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The hashing before issue 65, verbatim but for the loop's shape: the baseline."""
    tokens, hashes = request.all_token_ids, []
    for i in range(n_full):
        start, end = i * block_size, (i + 1) * block_size
        extra = tuple((img.content_hash, max(start - img.offset, 0))
                      for img in request.images if img.offset < end and img.end > start)
        if i == 0 and request.cache_salt:
            extra = (("salt", request.cache_salt),) + extra
        if i == 0 and request.lora_adapter:
            extra = (("lora", request.lora_adapter),) + extra
        parent = hashes[i - 1] if i else _OLD_ROOT
        record = (parent, tuple(tokens[start:end]), extra)
        hashes.append(hashlib.sha256(pickle.dumps(record, protocol=5)).digest())
    return hashes


def packed_hashes(request: Request, n_full: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The engine's hashing now."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, request, n_full, block_size)
    return hashes


def warm_request(num_blocks: int, image_tokens: int, images: int = 1, seed: int = 0) -> Request:
    """A prompt of num_blocks full blocks (+1 token) whose `images` images hold image_tokens in all."""
    rng = random.Random(seed)
    n = num_blocks * BLOCK_SIZE + 1
    tokens = [rng.randrange(150_000) for _ in range(n)]
    per_image = image_tokens // max(images, 1)
    placeholders, offset = [], 24
    for k in range(images):
        tokens[offset:offset + per_image] = [151_655] * per_image
        placeholders.append(ImagePlaceholder(offset=offset, length=per_image, content_hash=f"{k:064x}"))
        offset += per_image + 8
    return Request("bench", tokens, SamplingParams(), max_tokens=1, images=placeholders,
                   cache_salt="tenant", lora_adapter="")


def time_per_block(fns: Sequence[Callable[[], object]], num_blocks: int, repeats: int) -> list[float]:
    """Minimum microseconds per block of each function, run interleaved."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return [b * 1e6 / num_blocks for b in best]


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the block-hash benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.block_hash", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=482, help="full blocks of the request (482: 30 s video)")
    p.add_argument("--image-tokens", type=int, default=7680, help="placeholder tokens over its images")
    p.add_argument("--images", type=int, default=1, help="images (or video spans) sharing image-tokens")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the comparison, print it, save it when --out is given."""
    args = build_arg_parser().parse_args(argv)
    args.device = "cpu"
    request = warm_request(args.blocks, args.image_tokens, args.images)
    old_us, new_us = time_per_block([lambda: pickle_hashes(request, args.blocks),
                                     lambda: packed_hashes(request, args.blocks)], args.blocks, args.repeats)
    results = {"blocks": args.blocks, "images": args.images, "pickle_us_per_block": old_us,
               "packed_us_per_block": new_us, "pickle_ms_per_request": old_us * args.blocks / 1e3,
               "packed_ms_per_request": new_us * args.blocks / 1e3, "speedup": old_us / new_us}
    print_table(f"block hashing, {args.blocks} blocks, {args.images} image(s)",
                ["hashing", "us / block", "ms / request"],
                [["pickle + sha256 (before)", old_us, results["pickle_ms_per_request"]],
                 ["packed + sha256 (now)", new_us, results["packed_ms_per_request"]]])
    return save_result("block_hash", args, results)


if __name__ == "__main__":
    main()
