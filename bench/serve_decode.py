"""Decode tokens/s through gRPC against the in-process engine, at the same batch, in one run.

    python -m bench.serve_decode --model DIR [--device cuda --dtype bfloat16] [--batch-sizes 8,32]
    python -m bench.serve_decode --preset tiny --batch-sizes 4 --output-len 32      (a CPU smoke run)

Same weights, same engine settings, text-only prompts of --prompt-len tokens, exactly --output-len new
tokens (EOS ignored), greedy. Both sides count the same thing: tokens produced after every one of the
batch's requests has its first token, over the time from then until the last finishes.

- engine: LLMEngine in this process (bench.decode_tput's timing), with the engine's default of
  detokenizing on its own thread;
- served: a decoder service (and its encoder) in subprocesses, B concurrent streaming Generate calls
  from one asyncio client, the service as a user runs it.

served / engine near 1 means the GPU does not wait on the serving path (gRPC, the event loop, stream
delivery, detokenization); the serving-path issue asks for >= 0.9 at 8 and 32 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Sequence

import torch

from bench.decode_tput import engine_decode
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import Pair, exit_on_sigterm
from bench.stats import ratio
from bench.workload import PromptMaker
from common.client import AsyncDecoderClient
from decoder_svc.engine.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource

BLOCK_SIZE = 16


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.serve_decode", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per batch size (the best counts)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the same on both sides")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="both sides' --quantization (results are saved as serve_decode_fp8 for fp8)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="both sides' --tensor-parallel-size (results saved with a _tpN suffix for N > 1)")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="the engine's --async-scheduling, on both sides")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random language weights drawn on the device, on both sides")
    p.add_argument("--engine-only", action="store_true")
    p.add_argument("--served-only", action="store_true")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


def _num_blocks(args: argparse.Namespace, batch: int) -> int:
    per_seq = -(-(args.prompt_len + args.output_len + 8) // BLOCK_SIZE)
    return max(batch, args.max_num_seqs) * per_seq + 16


def in_process(args: argparse.Namespace, model: str, prompts: list[str],
               batches: list[int]) -> dict[int, float]:
    """Engine tokens/s per batch size (best of --repeats)."""
    config = EngineConfig(model, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                          num_kv_blocks=_num_blocks(args, max(batches)), max_num_seqs=args.max_num_seqs,
                          enable_prefix_caching=False, quantization=args.quantization,
                          tensor_parallel_size=args.tensor_parallel_size,
                          async_scheduling=args.async_scheduling, load_format=args.load_format)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    out = {}
    for b in batches:
        engine_decode(engine, prompts[0], b, 4)  # warm-up at this batch size
        best = 0.0
        for _ in range(args.repeats):
            seconds, tokens = engine_decode(engine, prompts[0], b, args.output_len)
            best = max(best, tokens / seconds if seconds else 0.0)
        out[b] = best
    engine.close()
    del engine
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return out


async def _served_round(address: str, prompt: str, batch: int, output_len: int) -> float:
    """Tokens/s of `batch` concurrent streams after all have their first token."""
    first: set[int] = set()
    all_started = asyncio.Event()
    t0 = 0.0
    counted = 0

    async def one(i: int) -> None:
        nonlocal t0, counted
        async with AsyncDecoderClient(address, timeout=600) as client:
            async for chunk in client.generate(prompt, max_tokens=output_len, ignore_eos=True,
                                               request_id=f"sd-{batch}-{i}"):
                if i not in first:
                    first.add(i)
                    n = len(chunk.token_ids) - 1  # the first token is prefill's
                    if len(first) == batch:
                        t0 = time.perf_counter()
                        all_started.set()
                    if all_started.is_set() and n > 0:
                        counted += n
                    continue
                if all_started.is_set():
                    counted += len(chunk.token_ids)

    await asyncio.gather(*(one(i) for i in range(batch)))
    seconds = time.perf_counter() - t0
    return counted / seconds if seconds > 0 else 0.0


def served(args: argparse.Namespace, model: str, prompts: list[str], batches: list[int]) -> dict[int, float]:
    """Service tokens/s per batch size (best of --repeats)."""
    decoder_args = ["--num-kv-blocks", str(_num_blocks(args, max(batches))), "--block-size", str(BLOCK_SIZE),
                    "--max-num-seqs", str(args.max_num_seqs), "--no-prefix-caching",
                    "--max-tokens-default", "16", "--quantization", args.quantization,
                    "--tensor-parallel-size", str(args.tensor_parallel_size),
                    "--async-scheduling", args.async_scheduling, "--load-format", args.load_format]
    out = {}
    with Pair(model, args.device, args.dtype, decoder_args=decoder_args, logs=args.logs) as pair:
        for b in batches:
            asyncio.run(_served_round(pair.decoder.address, prompts[0], b, 4))  # warm-up
            out[b] = max(asyncio.run(_served_round(pair.decoder.address, prompts[0], b, args.output_len))
                         for _ in range(args.repeats))
    return out


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    exit_on_sigterm()
    model = str(resolve_model(args))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [PromptMaker(model, seed=0).text(args.prompt_len)]
    ours = {} if args.served_only else in_process(args, model, prompts, batches)
    svc = {} if args.engine_only else served(args, model, prompts, batches)
    results = [{"batch": b, "engine_tokens_per_s": ours.get(b), "served_tokens_per_s": svc.get(b),
                "served_over_engine": ratio(svc.get(b) or 0.0, ours.get(b) or 0.0)} for b in batches]
    weights = args.dtype + (" weights fp8" if args.quantization == "fp8" else "")
    print_table(f"decode tokens/s, served through gRPC vs in-process, on {args.device} ({weights})",
                ["streams = batch", "in-process engine", "served (gRPC)", "served/engine"],
                [[r["batch"], r["engine_tokens_per_s"], r["served_tokens_per_s"], r["served_over_engine"]]
                 for r in results])
    name = "serve_decode_fp8" if args.quantization == "fp8" else "serve_decode"
    if args.tensor_parallel_size > 1:
        name += f"_tp{args.tensor_parallel_size}"
    return save_result(name, args, results)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
