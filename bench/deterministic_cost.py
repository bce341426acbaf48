"""What the deterministic mode costs, measured side by side in one run through gRPC (issue 66).

    python -m bench.deterministic_cost --model DIR --device cuda --dtype bfloat16 [--streams 1,32]
        [--encode-clients 64] [--images 256] [--cold-images 8] [--image-size 1024]
    python -m bench.deterministic_cost --preset qwen2.5-vl-tiny --streams 1,4 --encode-clients 4 \\
        --images 16 --cold-images 2 --image-size 64 --output-len 16          (a CPU smoke run)

For each mode (off, then `--deterministic` on both services) one encoder + decoder pair is started
and measured the same way:
- decode tokens/s at each --streams count (bench.serve_decode's count: tokens after every stream has
  its first token, text prompts, prefix caching off);
- Encode images/s with --encode-clients concurrent clients over --images distinct PNGs
  (bench.encode_tput's level, leases released at once; inline bytes, the transport any host can read);
- cold TTFT of one image request (a distinct image each, --cold-images of them, the median), and the
  reference request's tokens and logprobs before and after the load: in the mode they must repeat
  (`reference_repeats`).
Saved as benchmark `deterministic_cost`; `cost` gives on / off for each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence

from bench.encode_tput import _encode_level, make_pngs
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.serve_decode import _served_round
from bench.services import Pair, exit_on_sigterm
from bench.stats import ratio
from bench.workload import PromptMaker
from common.client import AsyncDecoderClient, generate_request
from common.pb import common_pb2

BLOCK_SIZE = 16


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.deterministic_cost", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--streams", default="1,32", help="decode stream counts")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--encode-clients", type=int, default=64)
    p.add_argument("--images", type=int, default=256, help="distinct PNGs of the Encode level")
    p.add_argument("--cold-images", type=int, default=8, help="cold TTFT requests (one distinct image each)")
    p.add_argument("--image-size", type=int, default=1024, help="square PNGs, pixels a side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: the decoder draws the language weights (made with --weights vision)")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


async def _first_token_s(address: str, prompt: str, image: bytes, salt: str) -> float:
    async with AsyncDecoderClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        request = generate_request(prompt, [image], max_tokens=1, cache_salt=salt)
        async for _ in client.stub.Generate(request, timeout=600):
            return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


async def _reference(address: str, prompt: str, image: bytes, salt: str) -> list:
    """The greedy reference's tokens and [logprob, top ids, top logprobs] per token."""
    out: list = []
    async with AsyncDecoderClient(address, timeout=600) as client:
        request = generate_request(prompt, [image], max_tokens=16, ignore_eos=True, cache_salt=salt,
                                   logprobs=2)
        async for chunk in client.stub.Generate(request, timeout=600):
            out += [[t, lp.logprob, list(lp.top_ids), list(lp.top_logprobs)]
                    for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)]
    return out


def measure_mode(args: argparse.Namespace, model: str, deterministic: bool) -> dict:
    """Every figure of one mode, on a pair of its own."""
    streams = [int(s) for s in args.streams.split(",")]
    per_seq = -(-(args.prompt_len + args.output_len + 8) // BLOCK_SIZE)
    flag = ["--deterministic"] if deterministic else []
    decoder_args = ["--num-kv-blocks", str(max(streams) * per_seq + 4096), "--block-size", str(BLOCK_SIZE),
                    "--load-format", args.load_format, *flag]
    words = PromptMaker(model, seed=args.seed)
    text = words.text(args.prompt_len)
    image_ask = words.image_prompt(words.text(24))
    pngs = make_pngs(args.images + args.cold_images + 1, args.image_size, args.seed + 7)
    ref_png, cold_pngs, load_pngs = pngs[0], pngs[1:1 + args.cold_images], pngs[1 + args.cold_images:]
    out: dict = {"deterministic": deterministic}
    pair = Pair(model, args.device, args.dtype, encoder_args=flag, decoder_args=decoder_args, logs=args.logs)
    with pair:
        address = pair.decoder.address
        before = asyncio.run(_reference(address, image_ask, ref_png, f"ref-{deterministic}-0"))
        for n in streams:
            asyncio.run(_served_round(address, text, n, 4))  # warm-up (graphs, allocations)
            out[f"decode_tok_s_{n}"] = asyncio.run(_served_round(address, text, n, args.output_len))
        level = asyncio.run(_encode_level(pair.encoder.address, load_pngs, args.encode_clients,
                                          [common_pb2.TRANSPORT_INLINE], 4))
        out["encode_img_s"] = level["images_per_s"]
        ttfts = [asyncio.run(_first_token_s(address, image_ask, png, f"cold-{deterministic}-{i}"))
                 for i, png in enumerate(cold_pngs)]
        out["cold_ttft_ms"] = 1000 * statistics.median(ttfts)
        after = asyncio.run(_reference(address, image_ask, ref_png, f"ref-{deterministic}-1"))
        warm = asyncio.run(_reference(address, image_ask, ref_png, f"ref-{deterministic}-0"))
        out["reference_repeats"] = before == after == warm
    return out


def run(args: argparse.Namespace) -> dict:
    """Both modes, then the table and the JSON payload."""
    exit_on_sigterm()
    model = str(resolve_model(args))
    off, on = measure_mode(args, model, False), measure_mode(args, model, True)
    figures = [k for k in off if k not in ("deterministic", "reference_repeats")]
    cost = {k: ratio(on[k], off[k]) for k in figures}
    print_table(f"the deterministic mode's cost on {args.device} ({args.dtype}); on/off",
                ["figure", "off", "on", "on/off"], [[k, off[k], on[k], cost[k]] for k in figures])
    print(f"reference repeats: off {off['reference_repeats']}, on {on['reference_repeats']}", flush=True)
    return save_result("deterministic_cost", args, {"off": off, "on": on, "cost": cost})


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run; 1 when the mode's reference did not repeat."""
    return 0 if run(build_arg_parser().parse_args(argv))["results"]["on"]["reference_repeats"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
