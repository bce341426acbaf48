"""TTFT with a cold vs a warm prefix, for one image plus about 600 text tokens.

    python -m bench.ttft_prefix --model DIR [--device cuda --dtype bfloat16] [--out ttft.json]
    python -m bench.ttft_prefix --addr 127.0.0.1:50052 --model DIR   (model: tokenizer for prompt length)

Each round sends, one at a time: a new image with new text (cold: encoder miss, no cached KV); the
identical request again (warm: the whole prefix is in the KV cache, the image is skipped); the same
image with new text (the image's embedding is cached by the encoder, the KV only up to the text).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import grpc

from bench.report import print_table, save_result
from bench.stats import ratio, summarize
from bench.targets import add_target_args, model_dir, target
from bench.workload import PromptMaker, random_png
from common.client import DecoderClient

CASES = ("cold", "warm_prefix", "image_cached_new_text")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the TTFT benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.ttft_prefix", description=__doc__.split("\n")[0])
    add_target_args(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=600, help="text tokens after the image")
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also time HF generate of one token on the cold "
                   "requests (PNG decode, processor, vision tower and prefill), in this process")
    p.add_argument("--out", default=None)
    return p


def hf_ttft(args: argparse.Namespace, cold: list[tuple[str, bytes]]) -> list[float]:
    """Seconds from PNG bytes to HF's first token, per cold request (HF has no prefix cache)."""
    import io

    from PIL import Image

    from bench.hf_ref import image_inputs, load_hf, timed_generate

    model, processor = load_hf(model_dir(args, True), args.device, args.dtype)
    out = []
    for i, (prompt, png) in enumerate([cold[0], *cold]):  # the first one again: warm-up
        t0 = time.perf_counter()
        inputs = image_inputs(model, processor, [prompt], [Image.open(io.BytesIO(png)).convert("RGB")],
                              args.device)
        seconds, _ = timed_generate(model, inputs, 1)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def ttft(client: DecoderClient, prompt: str, image: bytes) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, cached prompt tokens) of a 1-token generation."""
    t0 = time.perf_counter()
    first = None
    usage = None
    for chunk in client.generate(prompt, [image], max_tokens=1, ignore_eos=True):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        if chunk.finish_reason:
            usage = chunk.usage
    if first is None or usage is None:
        raise RuntimeError("the decoder returned no token")
    return first, usage.prompt_tokens, usage.cached_prompt_tokens


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    spawning = args.addr is None
    prompts = PromptMaker(model_dir(args, spawning), seed=args.seed)
    samples: dict[str, list[tuple[float, int, int]]] = {c: [] for c in CASES}
    cold: list[tuple[str, bytes]] = []
    with target(args, spawning) as (decoder, _), DecoderClient(decoder, timeout=600) as client:
        warm_img = random_png(args.seed * 7 + 99, args.image_size)  # first request pays one-off costs
        ttft(client, prompts.image_prompt(prompts.text(args.prompt_len)), warm_img)
        for r in range(args.rounds):
            image = random_png(args.seed * 1_000_003 + 31337 + r, args.image_size)
            prompt = prompts.image_prompt(prompts.text(args.prompt_len))
            cold.append((prompt, image))
            try:
                samples["cold"].append(ttft(client, prompt, image))
                samples["warm_prefix"].append(ttft(client, prompt, image))
                samples["image_cached_new_text"].append(
                    ttft(client, prompts.image_prompt(prompts.text(args.prompt_len)), image))
            except grpc.RpcError as exc:
                raise SystemExit(f"error: {exc.code().name}: {exc.details()}") from None
    results: dict = {}
    for case, rows in samples.items():
        results[case] = summarize([s[0] for s in rows])
        results[case]["mean_prompt_tokens"] = sum(s[1] for s in rows) / len(rows) if rows else None
        results[case]["mean_cached_prompt_tokens"] = sum(s[2] for s in rows) / len(rows) if rows else None
    results["cold_over_warm_p50"] = ratio(results["cold"]["p50_ms"], results["warm_prefix"]["p50_ms"])
    if args.hf:
        results["hf_cold"] = summarize(hf_ttft(args, cold))
        results["cold_over_hf_p50"] = ratio(results["cold"]["p50_ms"], results["hf_cold"]["p50_ms"])
        print_table("HF generate, first token of the cold requests (ms)", ["n", "mean", "p50", "p99",
                                                                          "mmserve cold / HF (p50)"],
                    [[results["hf_cold"]["n"], results["hf_cold"]["mean_ms"], results["hf_cold"]["p50_ms"],
                      results["hf_cold"]["p99_ms"], results["cold_over_hf_p50"]]])
    columns = ["case", "n", "mean", "p50", "p99", "prompt tok", "cached tok"]
    print_table("TTFT, one image + text (ms)", columns,
                [[c, results[c]["n"], results[c]["mean_ms"], results[c]["p50_ms"], results[c]["p99_ms"],
                  results[c]["mean_prompt_tokens"], results[c]["mean_cached_prompt_tokens"]] for c in CASES])
    return save_result("ttft_prefix", args, results)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
