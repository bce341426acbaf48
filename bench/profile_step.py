"""Where a decode step's time goes: host preparation, the model (graph replay or eager), sampling, and
the GPU kernels by total time.

    python -m bench.profile_step --model DIR --device cuda --dtype bfloat16 [--batch 1] [--enforce-eager]
    python -m bench.profile_step --model DIR ... --prompt-len 1880 --warm-tail 11

It prefills `--batch` text requests of `--prompt-len` tokens, then times `--steps` decode steps of the
engine (wall clock, synchronised), the runner's parts, and profiles the same steps' kernels with
torch.profiler. Launch overhead shows as wall time the kernels do not fill.

With `--warm-tail N` it profiles a warm request's one prefill step instead (the step of a repeated
request's time to first token): the prompt is computed once, then each of `--steps` requests repeats it
with N new tokens at its end and one output token, so its step computes the uncached tail (the prompt's
last partial block and the N tokens) over the cached prefix and samples the first token.

Both report the kernel launches per step, and with `--host-top K` the K Python functions that take the
most host time per step (cProfile over a separate run of the same steps: where a host-bound step's time
goes, e.g. which wrappers around the kernels).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Sequence

import torch

from bench.decode_tput import gemv_choices
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.workload import PromptMaker
from decoder_svc.engine.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sampling_params import SamplingParams


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the step profile."""
    p = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--piecewise-graphs", action="store_true",
                   help="a hybrid model's longer prefill steps in piecewise CUDA graphs (the engine option)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="the engine's --quantization")
    p.add_argument("--warm-tail", type=int, default=0,
                   help="profile the prefill step of a repeated prompt with this many new tokens (0: decode)")
    p.add_argument("--lora-adapter", default="", help="the requests' adapter (e.g. Phi-4's vision)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random language weights drawn on the device (a checkpoint made with "
                   "make-model --weights vision)")
    p.add_argument("--top", type=int, default=12, help="kernels to list")
    p.add_argument("--host-top", type=int, default=0,
                   help="list this many Python functions by host time per step (cProfile; 0: none)")
    p.add_argument("--out", default=None)
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    """Profile; returns the JSON payload."""
    model = resolve_model(args)
    device = torch.device(args.device)
    blocks = args.batch * (-(-(args.prompt_len + 3 * args.steps + 8) // 16)) + 8
    warm = args.warm_tail > 0
    if warm:  # the prompt once, then each request's own tail (its blocks stay cached until evicted)
        blocks = 2 * (-(-(args.prompt_len + args.warm_tail + 8) // 16)) * (args.steps + 8)
    config = EngineConfig(
        model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch, 1), num_kv_blocks=blocks,
        enable_prefix_caching=warm, attention_backend=args.attention_backend,
        # a hybrid stack's snapshot slots as a service's default (64 requests) has them, not one per
        # profiled sequence: a prompt's one step wants several
        num_state_snapshots=64 if warm else None,
        enforce_eager=args.enforce_eager, quantization=args.quantization, load_format=args.load_format,
        piecewise_graphs=args.piecewise_graphs)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    prompt = PromptMaker(model, seed=0).text(args.prompt_len)
    if warm:
        return _warm_prefill(args, engine, prompt, device)
    for i in range(args.batch):
        # Warm-up, the timed, the split-timed and the profiled runs: every profiled step decodes.
        params = SamplingParams(max_tokens=3 * args.steps + 16, ignore_eos=True)
        engine.add_request(f"p{i}", prompt, sampling=params, lora_adapter=args.lora_adapter)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # warm-up decode steps
        engine.step()
    # Parts of the runner, timed around its own calls.
    runner, parts = engine.runner, {"prepare": 0.0, "model": 0.0, "sample": 0.0}
    prepare, sample = runner._prepare, runner.sampler.sample

    def timed(name, fn):
        def wrapper(*a, **kw):
            _sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            _sync(device)
            parts[name] += time.perf_counter() - t0
            return out
        return wrapper

    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _sync(device)
    wall = (time.perf_counter() - t0) / args.steps
    runner._prepare, runner.sampler.sample = timed("prepare", prepare), timed("sample", sample)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _sync(device)
    parts["model"] = time.perf_counter() - t0 - parts["prepare"] - parts["sample"]
    runner._prepare, runner.sampler.sample = prepare, sample
    kernels = []
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            _sync(device)
        kernels = _kernel_table(prof, args.steps)
    host = _host_table(lambda: [engine.step() for _ in range(args.steps)], args.steps, args.host_top)
    gpu_us = sum(k["us_per_step"] for k in kernels)
    result = {"batch": args.batch, "graphs": runner.uses_cuda_graphs, "wall_ms_per_step": wall * 1e3,
              "tokens_per_s": args.batch / wall,
              **{f"{k}_ms_per_step": v / args.steps * 1e3 for k, v in parts.items()},
              "gpu_kernel_ms_per_step": gpu_us / 1e3, "launches_per_step": _launches(kernels),
              "kernels": kernels[:args.top], "host_functions": host}
    print_table(f"decode step, batch {args.batch}, graphs {runner.uses_cuda_graphs}",
                ["wall ms", "tok/s", "prepare ms", "model ms", "sample ms", "GPU kernels ms"],
                [[result[k] for k in ("wall_ms_per_step", "tokens_per_s", "prepare_ms_per_step",
                                      "model_ms_per_step", "sample_ms_per_step", "gpu_kernel_ms_per_step")]])
    _print_tables(kernels[:args.top], host)
    return save_result("profile_step", args, result, decode_gemv=gemv_choices())


def _warm_prefill(args: argparse.Namespace, engine: LLMEngine, prompt: str, device: torch.device) -> dict:
    """The prefill step of a repeated prompt with `--warm-tail` new tokens: wall, runner parts, kernels."""
    ids = engine.inputs.tokenizer.tokenizer(prompt, add_special_tokens=True).input_ids
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rng, counter = random.Random(0), iter(range(10**9))

    def one_request() -> tuple[float, int]:
        """Add the prompt with a new tail, step it to its first token; (wall seconds, tokens computed)."""
        n = next(counter)
        tail = rng.choices(ids[1:], k=args.warm_tail)  # text tokens of the prompt, in a new order
        engine.add_request(f"w{n}", prompt_token_ids=ids + tail, sampling=params,
                           lora_adapter=args.lora_adapter)
        _sync(device)
        t0, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            tokens += engine.last_step.num_tokens
        _sync(device)
        return time.perf_counter() - t0, tokens

    engine.add_request("base", prompt_token_ids=ids, sampling=params, lora_adapter=args.lora_adapter)
    while engine.has_unfinished():
        engine.step()
    for _ in range(4):
        one_request()  # warm-up: graphs, autotuning
    walls, tokens = zip(*(one_request() for _ in range(args.steps)), strict=True)
    kernels = []
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                one_request()
        kernels = _kernel_table(prof, args.steps)
    host = _host_table(lambda: [one_request() for _ in range(args.steps)], args.steps, args.host_top)
    wall = statistics.median(walls)
    result = {"prompt_tokens": len(ids) + args.warm_tail, "tokens_computed": statistics.median(tokens),
              "graphs": engine.runner.uses_cuda_graphs, "graph_steps": engine.runner.graph_steps,
              "wall_ms": wall * 1e3, "gpu_kernel_ms": sum(k["us_per_step"] for k in kernels) / 1e3,
              "launches_per_step": _launches(kernels), "kernels": kernels[:args.top], "host_functions": host}
    print_table(f"warm prefill step: {result['tokens_computed']} tokens over a {len(ids)}-token prompt",
                ["wall ms (median)", "GPU kernels ms", "graphs"],
                [[result["wall_ms"], result["gpu_kernel_ms"], result["graphs"]]])
    _print_tables(kernels[:args.top], host)
    return save_result("profile_warm_prefill", args, result, decode_gemv=gemv_choices())


def _host_table(run_steps, steps: int, top: int) -> list[dict]:
    """The `top` Python functions by their own host time over run_steps() (cProfile), per step."""
    if top <= 0:
        return []
    profiler = cProfile.Profile()
    profiler.runcall(run_steps)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, _)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{name} ({'/'.join(file.rsplit('/', 2)[-2:])}:{line})" if line else name,
             "calls_per_step": calls / steps, "self_ms_per_step": tottime / steps * 1e3,
             "cumulative_ms_per_step": cumtime / steps * 1e3}
            for (file, line, name), (_, calls, tottime, cumtime, _) in rows]


def _launches(kernels: list[dict]) -> float:
    """Kernel launches (and copies) per step, over every kernel the profile saw."""
    return sum(k["calls_per_step"] for k in kernels)


def _print_tables(kernels: list[dict], host: list[dict]) -> None:
    if kernels:
        print_table("kernels per step", ["kernel", "calls", "us"],
                    [[k["kernel"], k["calls_per_step"], k["us_per_step"]] for k in kernels])
    if host:
        print_table("host functions per step (cProfile)", ["function", "calls", "self ms", "cumulative ms"],
                    [[h["function"][:70], h["calls_per_step"], h["self_ms_per_step"],
                      h["cumulative_ms_per_step"]] for h in host])


def _kernel_table(prof, steps: int) -> list[dict]:
    """Kernels by device time per step, largest first."""
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t:
            kernels.append({"kernel": evt.key[:70], "calls_per_step": evt.count / steps,
                            "us_per_step": t / steps})
    return sorted(kernels, key=lambda k: -k["us_per_step"])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
