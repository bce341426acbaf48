"""Decode tokens/s at batch 1, 8 and 32: our engine vs HF `generate` vs the memory-bandwidth bound.

    python -m bench.decode_tput --model DIR [--device cuda --dtype bfloat16] [--out decode.json]

Both run in this process on the same weights, text-only prompts of --prompt-len tokens, exactly
--output-len new tokens (EOS ignored), greedy. Engine: the steps after the one that prefilled every
request, timed directly. HF: (t(output_len) - t(1)) over batch * (output_len - 1) tokens, i.e. its
prefill and first token taken out the same way (each t the fastest of HF_REPEATS generates). Bound:
batch * copy bandwidth / LM weight bytes, with the bandwidth measured here by a large same-device copy
(read + write bytes per second). With --lora-adapter the bound counts the adapter's bytes too (what a
step of LoRA products reads); `weights_bound` is the base weights' alone (what a step on a merged adapter
reads). A hybrid stack's linear layers also read and write each sequence's state every step:
`state_bound` counts those bytes beside the weights (batch x 2 x the state slot's bytes).
--merge-builtin-adapter both measures the engine twice, the checkpoint's own adapter merged
(decoder_svc/model/lora/merged.py) and not, each row saying which path its steps took.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence

import torch

from bench.bandwidth import adapter_bytes, bound_tokens_per_s, copy_bandwidth, weight_bytes
from bench.hf_ref import load_hf, text_inputs, timed_generate
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.stats import ratio
from bench.workload import PromptMaker
from common.checkpoint import parse_dtype
from decoder_svc.engine.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.model.linear_state import LinearStatePool

HF_REPEATS = 3  # HF's timings are the fastest of this many generates each


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the decode benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.decode_tput", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--copy-bytes", type=int, default=None, help="bytes of the bandwidth copy "
                   "(default 2 GiB on a GPU, 256 MiB on a CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF reference")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="the engine's --quantization (HF always runs the checkpoint as it is)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: the engine draws random weights (no HF reference then)")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="the engine's --async-scheduling")
    p.add_argument("--lora-adapter", default="",
                   help="every request runs with this adapter (a checkpoint's own, e.g. Phi-4-multimodal's "
                   "vision); HF runs the base weights, whose cost is the merged adapter's")
    p.add_argument("--merge-builtin-adapter", default="on", choices=("on", "off", "both"),
                   help="the engine's merged copy of the checkpoint's own adapter (off: "
                   "--no-merge-builtin-adapter); both: one engine each, one after the other")
    p.add_argument("--out", default=None)
    return p


def engine_decode(engine: LLMEngine, prompt: str, batch: int, output_len: int,
                  lora_adapter: str = "") -> tuple[float, int]:
    """(seconds, tokens) of the decode steps of `batch` requests after all were prefilled."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, sampling=params, lora_adapter=lora_adapter)
    started: set[str] = set()
    t0, tokens = None, 0
    while engine.has_unfinished():
        outs = engine.step()
        if t0 is None:
            started.update(o.request_id for o in outs if o.new_token_ids)
            if len(started) == batch:
                t0 = time.perf_counter()  # every request has its first token: decoding from here
            continue
        tokens += sum(len(o.new_token_ids) for o in outs)
    return (time.perf_counter() - t0 if t0 else 0.0), tokens


def measure_engine(args: argparse.Namespace, model: str, prompt: str, batches: list[int], merge: bool
                   ) -> tuple[dict[int, tuple[float, int, dict]], int, int, int]:
    """({batch: (seconds, tokens, steps by path)}, weight bytes, the adapter's bytes (0 without one), a
    sequence's linear-state bytes (0 for a stack without linear layers)) of one engine; freed after."""
    bs = 16
    blocks = max(batches) * (-(-(args.prompt_len + args.output_len + 8) // bs)) + 16
    config = EngineConfig(model, device=args.device, dtype=args.dtype, block_size=bs, num_kv_blocks=blocks,
                          max_num_seqs=max(batches),
                          max_num_batched_tokens=max(2048, max(batches) * (args.prompt_len + 8)),
                          enable_prefix_caching=False, quantization=args.quantization,
                          load_format=args.load_format, async_scheduling=args.async_scheduling,
                          merge_builtin_adapter=merge)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    weights = weight_bytes(engine.model)
    state = LinearStatePool.bytes_per_slot(engine.model.config, parse_dtype(args.dtype))
    runner = getattr(engine.runner, "runner", engine.runner)  # a tensor-parallel runner wraps rank 0's
    ours = {}
    for b in batches:
        engine_decode(engine, prompt, b, 4, args.lora_adapter)  # warm-up at this batch size
        before = (runner.lora_steps, runner.merged_steps)
        seconds, tokens = engine_decode(engine, prompt, b, args.output_len, args.lora_adapter)
        paths = {"lora_steps": runner.lora_steps - before[0], "merged_steps": runner.merged_steps - before[1]}
        ours[b] = (seconds, tokens, paths)
    adapter = adapter_bytes(engine.model) if args.lora_adapter else 0
    del engine, runner
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return ours, weights, adapter, state


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    model = resolve_model(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    prompt = PromptMaker(model, seed=0).text(args.prompt_len)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.merge_builtin_adapter]
    runs, weights, adapter_weights, state = {}, 0, 0, 0
    for merge in modes:
        runs[merge], weights, adapter_weights, state = measure_engine(args, model, prompt, batches, merge)
    copy_bytes = args.copy_bytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    bandwidth = copy_bandwidth(args.device, copy_bytes)
    hf: dict[int, float] = {}
    if not args.no_hf and args.load_format != "dummy":
        hf_model, processor = load_hf(model, args.device, args.dtype)
        for b in batches:
            inputs = text_inputs(processor, prompt, b, args.device)
            timed_generate(hf_model, inputs, 4)  # warm-up at this batch size
            # the fastest of a few: the difference of two timings is noise-prone on a busy host
            t1 = min(timed_generate(hf_model, inputs, 1)[0] for _ in range(HF_REPEATS))
            tn = min(timed_generate(hf_model, inputs, args.output_len)[0] for _ in range(HF_REPEATS))
            hf[b] = b * (args.output_len - 1) / (tn - t1) if tn > t1 else float("nan")
        del hf_model
    results = []
    for merge, ours in runs.items():
        for b in batches:
            seconds, tokens, paths = ours[b]
            tps = tokens / seconds if seconds else None
            bound = bound_tokens_per_s(b, bandwidth, weights + adapter_weights)
            weights_bound = bound_tokens_per_s(b, bandwidth, weights)
            # the states are read and written: twice their bytes at the copy bandwidth, per sequence
            state_bound = bound_tokens_per_s(b, bandwidth, weights + adapter_weights + 2 * b * state)
            results.append({"batch": b, "merge_builtin_adapter": merge, "engine_tokens_per_s": tps,
                            "hf_tokens_per_s": hf.get(b),
                            "engine_over_hf": ratio(tps or 0.0, hf.get(b) or 0.0),
                            "bound_tokens_per_s": bound,
                            "engine_fraction_of_bound": ratio(tps or 0.0, bound),
                            "weights_bound_tokens_per_s": weights_bound,
                            "engine_fraction_of_weights_bound": ratio(tps or 0.0, weights_bound),
                            "state_bound_tokens_per_s": state_bound if state else None,
                            "engine_fraction_of_state_bound": (ratio(tps or 0.0, state_bound) if state
                                                               else None),
                            "engine_decode_tokens": tokens, "engine_decode_s": seconds, **paths})
    adapter = f", adapter {args.lora_adapter}" if args.lora_adapter else ""
    print_table(f"decode tokens/s on {device} ({args.dtype}{adapter})",
                ["batch", "merged", "engine", "HF generate", "engine/HF", "bound", "engine/bound",
                 "engine/weights-bound", "engine/state-bound", "steps lora/merged"],
                [[r["batch"], "on" if r["merge_builtin_adapter"] else "off", r["engine_tokens_per_s"],
                  r["hf_tokens_per_s"], r["engine_over_hf"], r["bound_tokens_per_s"],
                  r["engine_fraction_of_bound"], r["engine_fraction_of_weights_bound"],
                  r["engine_fraction_of_state_bound"], f"{r['lora_steps']}/{r['merged_steps']}"]
                 for r in results])
    return save_result("decode_tput", args, results, weight_bytes=weights + adapter_weights,
                       base_weight_bytes=weights, lora_adapter=args.lora_adapter,
                       linear_state_bytes_per_sequence=state,
                       copy_bandwidth_bytes_per_s=bandwidth, decode_gemv=gemv_choices())


def gemv_choices() -> dict:
    """The fused one-row products' mode and start-up timings in this process ({} where the model never
    loaded them: CPU, the torch backend)."""
    module = sys.modules.get("decoder_svc.model.kernel_dispatch")
    return {} if module is None else {"mode": module.CHOICES.mode, "timings": module.CHOICES.summary()}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
