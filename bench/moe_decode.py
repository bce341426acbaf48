"""Mixture-of-experts decode (Qwen3-VL-30B-A3B): tokens/s at batch 1 and 32 streams against the
active-weights bandwidth bound and HF `generate` in the same run, with the routing's expert load.

    # CPU smoke (tests/bench/test_moe_decode.py runs this shape):
    python -m bench.moe_decode --preset qwen3-vl-moe-tiny --batch-sizes 1,4 --output-len 8
    # one H100 or H200, the real shapes (the tower written, the language weights drawn on the device, 61 GB
    # in bf16; each engine is freed before the next and before HF's random init of the same config):
    python -m common.cli make-model --preset qwen3-vl-30b-a3b --out /tmp/moe30b --dtype bfloat16 \
        --weights vision
    python -m bench.moe_decode --model /tmp/moe30b --device cuda --dtype bfloat16 --load-format dummy \
        --quantization none,fp8 --batch-sizes 1,32 --prompt-len 64 --output-len 64 --hf-repeats 2 \
        --out moe_decode.json

Each --quantization runs in its own engine (the same drawn weights; fp8 quantizes them at load). Streams
have distinct prompts of --prompt-len tokens (identical prompts would route alike and read fewer
experts), exactly --output-len new tokens, greedy; the engine's decode is timed from the step after every
stream has its first token (bench.decode_tput's method). HF: (t(output_len) - t(1)) over the streams'
tokens, each t the fastest of --hf-repeats generates, on the checkpoint's weights, or with
--load-format dummy (no language weights on disk) on HF's own random init of the same config
(`--hf-weights random`), its routers spread the same way: the same work, other values.

Routing (bench/moe_routing.py): random weights route unevenly; --router-spread (default: on with dummy
weights) redraws every router during one eager calibration prefill of --calibration-tokens tokens (more
than the largest captured CUDA graph) so top-k choices spread evenly. The expert load is then measured
on a probe prefill of one prompt per stream (the busiest expert's share over the mean, and the distinct
experts per layer a step of that many streams hits), and reported with the timings.

Bound: a decode step of b streams reads every weight outside the experts once (attention, norms,
routers, the output head, b embedding rows), the experts it hits in every MoE layer (top_k at b = 1; at
larger b the probe's count, and the uniform expectation for reference), each stream's KV cache (its
mean context over the run) and, for a hybrid stack (Qwen3.5-MoE), each stream's linear-layer state read
and written; bound tokens/s = b x copy bandwidth / those bytes.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.bandwidth import copy_bandwidth
from bench.hf_ref import load_hf, timed_generate
from bench.models import add_model_args, resolve_model
from bench.moe_routing import ExpertProbe, expert_load, routers, spread_routers, step_bytes
from bench.report import print_table, save_result
from bench.roofline import expected_experts
from bench.stats import ratio
from bench.workload import PromptMaker
from common.checkpoint import parse_dtype
from decoder_svc.engine.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.model.linear_state import LinearStatePool


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the MoE decode benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.moe_decode", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--quantization", default="none", help="comma-separated engine --quantization values "
                   "(none, fp8), each in its own engine")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--router-spread", default="auto", choices=("auto", "on", "off"),
                   help="redraw the routers so top-k choices spread evenly (auto: on with dummy weights)")
    p.add_argument("--calibration-tokens", type=int, default=1024,
                   help="the router spread's prefill (longer than the largest captured CUDA graph: 512)")
    p.add_argument("--hf-weights", default="auto", choices=("auto", "checkpoint", "random", "none"),
                   help="HF's weights: the checkpoint's, its own random init, or no HF run (auto: random "
                   "with dummy weights)")
    p.add_argument("--hf-repeats", type=int, default=3)
    p.add_argument("--copy-bytes", type=int, default=None, help="bytes of the bandwidth copy "
                   "(default 2 GiB on a GPU, 256 MiB on a CPU)")
    p.add_argument("--out", default=None)
    return p


def decode_streams(engine: LLMEngine, prompts: list[str], output_len: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps of one request per prompt, after all were prefilled."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{len(prompts)}-{i}-{tag}", prompt, sampling=params)
    started: set[str] = set()
    t0, tokens = None, 0
    while engine.has_unfinished():
        outs = engine.step()
        if t0 is None:
            started.update(o.request_id for o in outs if o.new_token_ids)
            if len(started) == len(prompts):
                t0 = time.perf_counter()  # every stream has its first token: decoding from here
            continue
        tokens += sum(len(o.new_token_ids) for o in outs)
    return (time.perf_counter() - t0 if t0 else 0.0), tokens


def _spread(args: argparse.Namespace) -> bool:
    return args.router_spread == "on" or (args.router_spread == "auto" and args.load_format == "dummy")


def run_engine(args: argparse.Namespace, model: Path, quantization: str, prompts: list[str],
               calibration: str, batches: list[int]) -> dict:
    """One engine's run: router spread, expert-load probe, timed decode per batch size; its figures."""
    bs, most = 16, max(batches)
    context = args.prompt_len + args.output_len + 8
    blocks = max(most * -(-context // bs), -(-(args.calibration_tokens + 16) // bs)) + 16
    config = EngineConfig(model, device=args.device, dtype=args.dtype, block_size=bs, num_kv_blocks=blocks,
                          max_num_seqs=most, enable_prefix_caching=False, quantization=quantization,
                          load_format=args.load_format, max_num_batched_tokens=max(
                              2048, most * (args.prompt_len + 8), args.calibration_tokens + 8))
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    cfg = engine.model.config
    found = routers(engine.model, cfg.num_experts, cfg.hidden_size)
    if _spread(args):
        spread_routers(found, lambda: decode_streams(engine, [calibration], 1))
    probe = ExpertProbe(found, cfg.num_experts_per_tok)
    probe.recording = True
    decode_streams(engine, prompts[:most], 1)  # one eager prefill of every stream's prompt
    probe.recording = False
    probe.close()
    load = expert_load(probe.layer_ids(), cfg.num_experts, most)
    size = parse_dtype(args.dtype).itemsize
    kv = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * size
    state = 2 * LinearStatePool.bytes_per_slot(cfg, parse_dtype(args.dtype))  # a hybrid stack's (Qwen3.5-MoE)
    parts = step_bytes(engine.model, kv, state)
    timings = {}
    for b in batches:
        decode_streams(engine, prompts[:b], 4)  # warm-up at this batch size
        timings[b] = decode_streams(engine, prompts[:b], args.output_len)
    engine = None  # frees the weights before the next engine or HF loads
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return {"quantization": quantization, "timings": timings, "load": load, "bytes": parts,
            "top_k": cfg.num_experts_per_tok, "num_experts": cfg.num_experts}


def load_hf_random(model_dir: Path, device: str, dtype: str):
    """(model, processor-like with .tokenizer): HF's class of the checkpoint's family on its config, HF's
    own random init on `device` (no weight files read)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from common.families.registry import family_of_model

    cls = getattr(transformers, family_of_model(model_dir).hf_class)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device(device):
        model = cls._from_config(config, dtype=parse_dtype(dtype)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, SimpleNamespace(tokenizer=tok)


def run_hf(args: argparse.Namespace, model_dir: Path, prompts: list[str], calibration: str,
           batches: list[int], weights: str) -> dict[int, float]:
    """HF generate's decode tokens/s per batch size (distinct prompts, as ours)."""
    if weights == "random":
        hf, processor = load_hf_random(model_dir, args.device, args.dtype)
    else:
        hf, processor = load_hf(model_dir, args.device, args.dtype)
    text = hf.config.get_text_config()
    if _spread(args):
        found = routers(hf, text.num_experts, text.hidden_size)
        inputs = processor.tokenizer([calibration], return_tensors="pt").to(args.device)
        with torch.inference_mode():
            spread_routers(found, lambda: hf(**inputs))
    out = {}
    for b in batches:
        inputs = dict(processor.tokenizer(prompts[:b], return_tensors="pt", padding=True).to(args.device))
        timed_generate(hf, inputs, 4)  # warm-up at this batch size
        t1 = min(timed_generate(hf, inputs, 1)[0] for _ in range(args.hf_repeats))
        tn = min(timed_generate(hf, inputs, args.output_len)[0] for _ in range(args.hf_repeats))
        out[b] = b * (args.output_len - 1) / (tn - t1) if tn > t1 else float("nan")
    hf = None
    gc.collect()
    return out


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    model = resolve_model(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    maker = PromptMaker(model, seed=0)
    prompts = [maker.text(args.prompt_len) for _ in range(max(batches))]
    calibration = maker.text(args.calibration_tokens)
    engines = [run_engine(args, model, q, prompts, calibration, batches)
               for q in args.quantization.split(",")]
    hf_weights = args.hf_weights
    if hf_weights == "auto":
        hf_weights = "random" if args.load_format == "dummy" else "checkpoint"
    cuda = torch.device(args.device).type == "cuda"
    left_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None  # what the engines left behind
    tilings = []
    if cuda:  # the decode batches' measured tilings (common/kernels/fused_moe.py's choose_config)
        from common.kernels.moe_tuning import tuning_summary

        tilings = tuning_summary()
    hf = run_hf(args, model, prompts, calibration, batches, hf_weights) if hf_weights != "none" else {}
    copy_bytes = args.copy_bytes or ((2 << 30) if cuda else (256 << 20))
    bandwidth = copy_bandwidth(args.device, copy_bytes)
    context = args.prompt_len + args.output_len / 2  # each stream's mean context over the timed steps
    results, base = [], {}
    for e in engines:
        load, parts = e["load"], e["bytes"]
        for b in batches:
            seconds, tokens = e["timings"][b]
            tps = tokens / seconds if seconds else None
            uniform = expected_experts(e["num_experts"], e["top_k"], b)
            measured = e["top_k"] if b == 1 else (load.experts_per_step if b == load.streams else None)
            hit = measured if measured is not None else uniform
            step = parts.total(b, hit, context)
            bound = b * bandwidth / step
            if e["quantization"] == "none":
                base.setdefault(b, tps)
            results.append({
                "quantization": e["quantization"], "batch": b, "engine_tokens_per_s": tps,
                "hf_tokens_per_s": hf.get(b), "engine_over_hf": ratio(tps or 0.0, hf.get(b) or 0.0),
                "bound_tokens_per_s": bound, "engine_fraction_of_bound": ratio(tps or 0.0, bound),
                "over_bf16": ratio(tps or 0.0, base.get(b) or 0.0) if e["quantization"] != "none" else None,
                "experts_hit_per_layer": hit, "experts_hit_uniform": uniform, "step_bytes": step,
                "bytes_per_token": step / b,
                "engine_decode_tokens": tokens, "engine_decode_s": seconds})
    print_table(f"MoE decode tokens/s on {args.device} ({args.dtype}, {args.load_format} weights)",
                ["quant", "batch", "engine", "HF generate", "engine/HF", "bound", "engine/bound",
                 "experts/layer", "x bf16"],
                [[r["quantization"], r["batch"], r["engine_tokens_per_s"], r["hf_tokens_per_s"],
                  r["engine_over_hf"], r["bound_tokens_per_s"], r["engine_fraction_of_bound"],
                  r["experts_hit_per_layer"], r["over_bf16"]] for r in results])
    for e in engines:
        load = e["load"]
        print(f"expert load ({e['quantization']}): {load.tokens} tokens x {e['top_k']} per layer, busiest "
              f"expert {load.imbalance_mean:.2f}x the mean (worst layer {load.imbalance_max:.2f}x), "
              f"{load.experts_per_step} experts per layer at {load.streams} streams", flush=True)
    headline = [[f"MoE decode {r['quantization']} b{r['batch']}: {what}", r[key]] for r in results
                for what, key in (("tok/s", "engine_tokens_per_s"), ("of bound", "engine_fraction_of_bound"),
                                  ("HF tok/s", "hf_tokens_per_s"), ("over bf16", "over_bf16"))
                if r[key] is not None]
    return save_result("moe_decode", args, results, headline=headline, copy_bandwidth_bytes_per_s=bandwidth,
                       router_spread=_spread(args), hf_weights=hf_weights, cuda_gib_after_engines=left_gib,
                       expert_load={e["quantization"]: asdict(e["load"]) for e in engines},
                       step_bytes={e["quantization"]: asdict(e["bytes"]) for e in engines},
                       moe_tilings=tilings)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv and run."""
    run(build_arg_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
