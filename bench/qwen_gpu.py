"""Qwen2.5-VL or Qwen3-VL on one GPU, side by side with HF transformers on the same weights, in one process.

    python -m bench.qwen_gpu --model DIR [--device cuda --dtype bfloat16] [--out qwen.json]

The family follows the checkpoint's model_type: `qwen2_5_vl` (HF's Qwen2_5_VLForConditionalGeneration,
results saved as benchmark `qwen_gpu`, headline rows "qwen ...") or `qwen3_vl`
(Qwen3VLForConditionalGeneration, benchmark `qwen3_gpu`, rows "qwen3 ..."), so both can be merged into
one results.json. For Qwen3-VL both
towers do the same work: the merged features and every DeepStack level (HF's `visual` returns both).

Figures (JSON with a `headline`):
- vision tower: distinct --image-size square images per second, ours (batches of 1 and --batch, the
  device-side processor included, eager and with the elementwise steps compiled) vs HF's `visual` on
  the HF processor's pixel values (its host time per image beside it), and the top kernels of ours;
- cold TTFT: one image + --text-tokens text tokens through the engine with an in-process tower
  (encode, prefill, first token), median of --ttft-rounds distinct images; HF's generate(max_new_tokens=1);
- decode at batch 1: tokens/s after the first token (ignore EOS), engine vs HF generate, and the
  bandwidth bound (LM weight bytes / copy bandwidth);
- greedy agreement in the dtype, teacher-forced: for --agreement-prompts prompts with one 448x448
  image each, HF generates --agreement-tokens tokens; for each prefix of HF's sequence the engine
  predicts the next token (one request per prefix; the shared prefix is cached), and the figure is
  the fraction equal to HF's. Free-running sequences diverge for good at the first near-tie of
  random weights, so the identical-sequence count is reported beside it. The noise floor beside it:
  HF against itself, its one-pass forward over the same prefixes against its own incremental decoding
  (the same weights and dtype, the work only batched differently).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch
from PIL import Image

from bench.bandwidth import copy_bandwidth
from bench.report import save_result
from bench.workload import QWEN_END, QWEN_IMAGE, QWEN_USER
from common.checkpoint import load_config, parse_dtype
from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor
from common.vision.encoders import make_vision_encoder
from common.vision.prepared import PreparedGrid
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.sampling_params import SamplingParams

USER, END, IMAGE = QWEN_USER, QWEN_END, QWEN_IMAGE

# model_type -> (family label of the headline rows, benchmark name, HF class in transformers)
FAMILIES = {"qwen2_5_vl": ("qwen", "qwen_gpu", "Qwen2_5_VLForConditionalGeneration"),
            "qwen3_vl": ("qwen3", "qwen3_gpu", "Qwen3VLForConditionalGeneration")}


def family_of(model_dir) -> tuple[str, str, str]:
    """(label, benchmark name, HF class name) of a Qwen-VL checkpoint; ValueError for any other."""
    model_type = load_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{model_dir}: model_type {model_type!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def load_hf(model_dir, device: torch.device, dtype: torch.dtype):
    """HF's model of the checkpoint's family, in dtype on device, eval mode."""
    import transformers

    cls = getattr(transformers, family_of(model_dir)[2])
    return cls.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the Qwen2.5-VL / Qwen3-VL benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.qwen_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--images", type=int, default=16, help="distinct images for the tower figures")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--text-tokens", type=int, default=500)
    p.add_argument("--ttft-rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--agreement-prompts", type=int, default=20)
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--kv-cache-bytes", type=int, default=16 << 30)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default=None)
    return p


def images(n: int, side: int, seed: int = 0) -> list[Image.Image]:
    """n distinct random RGB images."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tower_figures(engine: LLMEngine, hf, imgs: list[Image.Image], batch: int) -> dict:
    """Images per second of our tower (batch 1 and `batch`) and HF's, on prepared images."""
    t0 = time.perf_counter()
    hf_prepared = [hf_prepare(engine, i) for i in imgs]
    prep_ms = (time.perf_counter() - t0) * 1000 / len(imgs)
    # The family's encoder (QwenVisionEncoder or Qwen3VisionEncoder), device-side processor on a GPU.
    enc = make_vision_encoder(engine.config.model, engine.device, engine.dtype)
    prepared = [enc.prepare(i) for i in imgs]
    out: dict = {"hf_processor_ms_per_image": round(prep_ms, 2), "preprocess": enc.preprocess_mode,
                 "tokens_per_image": enc.layout.num_tokens(prepared[0].grid)}

    def rate(fn, size: int) -> float:
        fn(prepared[:size])  # warm-up (kernels, allocator)
        sync(enc.device)
        t = time.perf_counter()
        for k in range(0, len(prepared) - size + 1, size):
            fn(prepared[k:k + size])
        sync(enc.device)
        return (len(prepared) // size * size) / (time.perf_counter() - t)

    out["eager_img_s_b1"] = round(rate(enc.encode_prepared, 1), 2)
    out[f"eager_img_s_b{batch}"] = round(rate(enc.encode_prepared, batch), 2)
    out["compiled"] = enc.compile_elementwise()
    out["ours_img_s_b1"] = round(rate(enc.encode_prepared, 1), 2)
    out[f"ours_img_s_b{batch}"] = round(rate(enc.encode_prepared, batch), 2)
    if enc.device.type == "cuda":
        out["top_kernels"] = top_kernels(lambda: enc.encode_prepared(prepared[:batch]))
    prepared = hf_prepared
    if hf is not None:
        def hf_fn(chunk):
            pv = torch.cat([p.pixel_values for p in chunk]).to(enc.device, hf.dtype)
            grid = torch.tensor([p.grid for p in chunk], device=enc.device)
            with torch.no_grad():  # Qwen3-VL: the merged features and the DeepStack levels, as ours
                hf.model.visual(pv, grid_thw=grid)
        out["hf_img_s_b1"] = round(rate(hf_fn, 1), 2)
        out[f"hf_img_s_b{batch}"] = round(rate(hf_fn, batch), 2)
    return out


def top_kernels(fn, n: int = 12) -> list[list]:
    """[name, ms, calls] of the n kernels with the most CUDA time in one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, "device_time_total", 0), reverse=True)
    return [[e.key[:70], round(getattr(e, "device_time_total", 0) / 1000, 2), e.count] for e in rows[:n]]


def text_of(engine: LLMEngine, n_tokens: int) -> str:
    """A prompt body of about n_tokens tokens."""
    words = "the image shows a red car on a table beside a tree under the blue sky".split()
    text, k = "", 0
    while len(engine.tokenizer.tokenizer(text)["input_ids"]) < n_tokens:
        text += words[k % len(words)] + " "
        k += 1
    return text


def ttft(engine: LLMEngine, hf, side: int, text: str, rounds: int) -> dict:
    """Cold time to first token: encode + prefill + one token, fresh images each round."""
    prompt = USER + IMAGE + text + END
    ours, theirs = [], []
    for i, img in enumerate(images(rounds + 1, side, seed=100)):
        sync(engine.device)
        t = time.perf_counter()
        engine.generate(f"ttft{i}", prompt, [img], sampling=SamplingParams(max_tokens=1))
        sync(engine.device)
        if i:
            ours.append(time.perf_counter() - t)
        if hf is not None:
            inputs = hf_inputs(engine, hf, prompt, [img])
            sync(engine.device)
            t = time.perf_counter()
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=1, do_sample=False)
            sync(engine.device)
            if i:
                theirs.append(time.perf_counter() - t)
    out = {"ours_ms": round(statistics.median(ours) * 1000, 1)}
    if theirs:
        out["hf_ms"] = round(statistics.median(theirs) * 1000, 1)
    return out


@functools.cache
def _hf_processor(model: str):
    return load_qwen_image_processor(model)


def hf_prepare(engine: LLMEngine, image: Image.Image) -> PreparedGrid:
    """One image through the checkpoint's HF image processor (what HF's model is given)."""
    out = _hf_processor(str(engine.config.model))(images=[image], return_tensors="pt")
    return PreparedGrid(tuple(int(x) for x in out["image_grid_thw"][0]), pixel_values=out["pixel_values"])


def hf_inputs(engine: LLMEngine, hf, prompt: str, imgs: list[Image.Image]) -> dict:
    """HF's inputs as its processor would make them (the image processor and the tokenizer)."""
    enc = engine.source.encoder
    counts, values, grids = [], [], []
    for img in imgs:
        p = hf_prepare(engine, img)
        values.append(p.pixel_values)
        grids.append(p.grid)
        counts.append(enc.layout.num_tokens(p.grid))
    pieces = prompt.split("<|image_pad|>")
    text = pieces[0] + "".join("<|image_pad|>" * n + s for n, s in zip(counts, pieces[1:], strict=True))
    tok = engine.tokenizer.tokenizer(text, return_tensors="pt")
    ids = tok["input_ids"].to(engine.device)
    out = {"input_ids": ids, "attention_mask": tok["attention_mask"].to(engine.device),
           "mm_token_type_ids": (ids == engine.tokenizer.image_token_id).int()}
    if imgs:
        out["pixel_values"] = torch.cat(values).to(engine.device, hf.dtype)
        out["image_grid_thw"] = torch.tensor(grids, device=engine.device)
    return out


def decode_rate(engine: LLMEngine, hf, n: int) -> dict:
    """Batch-1 decode tokens/s after the first token."""
    prompt = USER + "describe a red car" + END
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    engine.generate("warm", prompt, sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("dec", prompt, sampling=params)
    t0, count = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if t0 is None and out.new_token_ids:
                sync(engine.device)
                t0 = time.perf_counter()
            elif t0 is not None:
                count += len(out.new_token_ids)
    sync(engine.device)
    res = {"ours_tok_s": round(count / (time.perf_counter() - t0), 1)}
    if hf is not None:
        inputs = hf_inputs(engine, hf, prompt, [])
        del inputs["mm_token_type_ids"]
        times = []
        for m in (1, n):
            sync(engine.device)
            t = time.perf_counter()
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=m, min_new_tokens=m, do_sample=False)
            sync(engine.device)
            times.append(time.perf_counter() - t)
        res["hf_tok_s"] = round((n - 1) / (times[1] - times[0]), 1)
    return res


def agreement(engine: LLMEngine, hf, prompts: int, tokens: int) -> dict:
    """Teacher-forced agreement of the engine's greedy next token with HF's (see the module docstring)."""
    from common.families.qwen2_5_vl.layout import mrope_positions

    equal = total = identical = floor = 0
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, img in enumerate(images(prompts, 448, seed=7)):
        prompt = USER + IMAGE + f"question {i}: what is in this picture?" + END
        free = engine.generate(f"free{i}", prompt, [img],
                               sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
        inputs = hf_inputs(engine, hf, prompt, [img])
        with torch.no_grad():
            seq = hf.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        ref = seq[0, inputs["input_ids"].shape[1]:].tolist()
        identical += free.new_token_ids == ref
        for j in range(len(ref)):  # the prompt plus HF's first j tokens: does our next token equal HF's?
            req = engine.inputs.make_request(f"tf{i}-{j}", prompt, [img], sampling=greedy)
            req.prompt_token_ids = req.prompt_token_ids + ref[:j]
            req.mrope_positions, req.mrope_delta = mrope_positions(
                len(req.prompt_token_ids), [(p.offset, p.grid) for p in req.images],
                engine.tokenizer.layout.merge_size)
            engine.add(req)
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        equal += sum(outs.get(f"tf{i}-{j}", [None])[0] == ref[j] for j in range(len(ref)))
        total += len(ref)
        floor += hf_self_agreement(hf, inputs, ref)
    return {"token_agreement": round(equal / max(total, 1), 4), "identical_sequences": identical,
            "hf_self_agreement": round(floor / max(total, 1), 4),
            "prompts": prompts, "tokens_per_prompt": tokens}


def hf_self_agreement(hf, inputs: dict, ref: list[int]) -> int:
    """How many of ref's tokens HF's one-pass forward over prompt + ref[:-1] predicts (greedy)."""
    n = inputs["input_ids"].shape[1]
    extra = torch.tensor([ref[:-1]], device=inputs["input_ids"].device)
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1).int()
    with torch.no_grad():
        logits = hf(**full).logits[0, n - 1:]
    return sum(a == b for a, b in zip(logits.argmax(-1).tolist(), ref, strict=True))


def main(argv: list[str] | None = None) -> int:
    """Run every figure; print and save the JSON."""
    args = build_arg_parser().parse_args(argv)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    label, name, _ = family_of(args.model)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=8, max_num_batched_tokens=4096)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    hf = None if args.no_hf else load_hf(args.model, device, dtype)
    result: dict = {"model": str(args.model), "family": label, "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "dtype": args.dtype}
    result["tower"] = tower_figures(engine, hf, images(args.images, args.image_size), args.batch)
    print("tower", result["tower"], flush=True)
    result["ttft"] = ttft(engine, hf, args.image_size, text_of(engine, args.text_tokens), args.ttft_rounds)
    print("ttft", result["ttft"], flush=True)
    result["decode_b1"] = decode_rate(engine, hf, args.decode_tokens)
    lm_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if device.type == "cuda":
        bw = copy_bandwidth(args.device, 2 << 30)
        result["decode_b1"]["bound_tok_s"] = round(bw / lm_bytes, 1)
        result["decode_b1"]["fraction_of_bound"] = round(result["decode_b1"]["ours_tok_s"] * lm_bytes / bw, 3)
    print("decode", result["decode_b1"], flush=True)
    if hf is not None and args.agreement_prompts:
        result["agreement"] = agreement(engine, hf, args.agreement_prompts, args.agreement_tokens)
        print("agreement", result["agreement"], flush=True)
    t, b = result["tower"], args.batch
    result["headline"] = [
        [f"{label} tower img/s (ours b1 / b{b})", f"{t['ours_img_s_b1']} / {t[f'ours_img_s_b{b}']}"],
        [f"{label} tower img/s (HF b1 / b{b})", f"{t.get('hf_img_s_b1')} / {t.get(f'hf_img_s_b{b}')}"],
        [f"{label} cold TTFT ms (ours / HF)", f"{result['ttft']['ours_ms']} / {result['ttft'].get('hf_ms')}"],
        [f"{label} decode b1 tok/s (ours / HF / bound)", f"{result['decode_b1']['ours_tok_s']} / "
         f"{result['decode_b1'].get('hf_tok_s')} / {result['decode_b1'].get('bound_tok_s')}"],
        [f"{label} greedy agreement with HF", str(result.get("agreement", {}).get("token_agreement"))],
    ]
    save_result(name, args, result, headline=result["headline"])
    print(result["headline"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
