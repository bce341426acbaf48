"""Time to first token through the services, with where it goes: cold, warm, a follow-up, and 32 at once.

    python -m bench.ttft --model DIR [--device cuda --dtype bfloat16] [--hf] [--out ttft.json]

One encoder and one decoder on the checkpoint (any served family), then, one request at a time through
gRPC `Generate` (1 output token):
- cold: a new --image-size PNG of noise + about --text-tokens tokens of text (every image misses);
- warm: the identical request again (its prefix is cached: all but the last tokens);
- follow-up: the same image with a new question of about --followup-tokens tokens (the prefix cached up
  to the image's end: its KV blocks, and on a hybrid stack the state snapshot taken there);
each with the decoder's TTFT split (GetStats `ttft_stage_seconds`: input, submit, encode, queue,
prefill, output; decoder_svc/engine/ttft_stages.py), the request's inbound `crossing` of gRPC (the
client's call to the front end's `received` stamp, read from the core's step trace; the rest of the
client's figure is the first token's way back; `crossing_floor` is what the same requests' crossing
costs a bare gRPC server on this host, bench/grpc_floor.py) and the encoder's Encode split
(`stage_seconds`) over the cold rounds. Then --concurrency requests at once (distinct images,
--burst-words words each, --burst-tokens output tokens; with --arrival-seconds S they arrive as a Poisson
process over about S seconds instead, and the TTFT has its p99 and p99 / p50): TTFT p50 / max, wall, and
the wall over a roofline made of the images at the cold rounds' tower device time each (measured alone:
batching only lowers it), the prompt tokens at the cold rounds' prefill rate and the decode steps at the
copy bandwidth (the language model's weights read once per step). With --hf, HF's
`generate(max_new_tokens=1)` on the same weights and the cold prompts after the services stop (its
processor excluded, as in bench/qwen_gpu.py).
The result says how the embeddings came (`embedding_transports`). --transports cuda_ipc,nixl,inline
starts one decoder per transport (told to ask for it) beside the one encoder and measures each in turn:
the cold TTFT per transport, side by side (`cold_p50_ms_by_transport`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from bench.grpc_floor import crossing_floor
from bench.report import save_result
from bench.services import Service, decoder_service, encoder_service, start_all, workdir
from bench.stats import percentile
from bench.step_trace import read_trace, summarize
from bench.svcstats import stage_split
from bench.workload import PromptMaker, random_png, random_words
from common.checkpoint import load_config
from common.client import AsyncDecoderClient, DecoderClient, EncoderClient, generate_request

COPY_BANDWIDTH = 4.27e12  # H200 device copy, bytes/s (bench/bandwidth.py measured 4.27-4.29)


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the TTFT benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.ttft", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5,
                   help="cold, warm and follow-up rounds (after two unmeasured ones)")
    p.add_argument("--concurrency", type=int, default=32, help="requests of the burst (0: none)")
    p.add_argument("--arrival-seconds", type=float, default=0.0,
                   help="the burst's requests arrive as a Poisson process over about this many seconds "
                   "instead of at once (0); its TTFT then has a p99 and p99 / p50")
    p.add_argument("--followup-tokens", type=int, default=32, help="the follow-up question's length")
    p.add_argument("--burst-words", type=int, default=24)
    p.add_argument("--burst-tokens", type=int, default=32)
    p.add_argument("--hf", action="store_true", help="HF generate on the cold prompts")
    p.add_argument("--decoder-args", default="", help="extra decoder flags, one string")
    p.add_argument("--encoder-args", default="", help="extra encoder flags, one string")
    p.add_argument("--transports", default=None,
                   help="comma-separated embedding transports (cuda_ipc, shm, nixl, inline): one decoder "
                   "per entry told to ask for it (--embedding-transports), all started at once beside one "
                   "encoder (with --nixl when nixl is listed), measured one after another; give each "
                   "decoder's KV cache a size in --decoder-args (--kv-cache-bytes) so they fit together")
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    return p


def ms(seconds: float) -> float:
    """Milliseconds, rounded for a report."""
    return round(seconds * 1000, 2)


class Probe:
    """A decoder's and the encoder's clients and the stage sums read before and after each measured
    request; `trace` is the decoder's step trace."""

    def __init__(self, decoder: Service, encoder: Service, trace: Path) -> None:
        self.decoder = DecoderClient(decoder.address, timeout=600)
        self.encoder = EncoderClient(encoder.address, timeout=60)
        self.address = decoder.address
        self.trace = trace

    def snapshot(self) -> dict:
        """Both services' stats as dicts (field names as in the protos)."""
        opts = {"preserving_proto_field_name": True}
        return {"decoder": MessageToDict(self.decoder.stats(), **opts),
                "encoder": MessageToDict(self.encoder.stats(), **opts)}

    def ttft(self, prompt: str, png: bytes, salt: str) -> tuple[float, dict]:
        """(seconds to the first token, the stage split of this request: decoder and encoder, ms)."""
        before = self.snapshot()
        started, first = time.monotonic(), None
        for chunk in self.decoder.generate(prompt, [png], max_tokens=1, ignore_eos=True, cache_salt=salt):
            if first is None and chunk.token_ids:
                first = time.monotonic() - started
        split = split_between(before, self.snapshot())
        if first is not None:
            split["decoder"]["crossing"] = ms(crossing_in(self.trace, started, started + first))
        return first if first is not None else float("nan"), split


def split_between(before: dict, after: dict) -> dict:
    """Mean ms per stage between two snapshots: the decoder's TTFT split and the encoder's Encode split."""
    out = {"decoder": stage_split(before["decoder"], after["decoder"]),
           "encoder": stage_split(before["encoder"], after["encoder"], "stage_seconds", "encode_calls")}
    g0, g1 = before["encoder"].get("tower_gpu_seconds", 0.0), after["encoder"].get("tower_gpu_seconds", 0.0)
    out["encoder_tower_gpu_ms"] = ms(g1 - g0)
    return out


def crossing_in(trace: Path, sent: float, got: float) -> float:
    """Seconds from the client's call to the front end's `received` stamp of the one request whose first
    token came in [sent, got] (the step trace's record of it; same host, same monotonic clock): the
    request crossing gRPC inbound. NaN when the trace has no such record."""
    stamps = [r for rec in read_trace(trace, sent, got) for r in rec.get("received", []) if sent <= r <= got]
    return stamps[0] - sent if len(stamps) == 1 else float("nan")


def mean_split(splits: list[dict], side: str) -> dict:
    """Stage by stage mean of the rounds' splits (ms)."""
    keys = {k for s in splits for k in s.get(side, {})}
    return {k: round(statistics.mean(s.get(side, {}).get(k, 0.0) for s in splits), 2) for k in sorted(keys)}


def summary(values: list[float]) -> dict:
    """p50 / mean / min / max in ms."""
    v = sorted(values)
    return {"p50_ms": ms(statistics.median(v)), "mean_ms": ms(statistics.mean(v)), "min_ms": ms(v[0]),
            "max_ms": ms(v[-1]), "n": len(v)}


def poisson_offsets(count: int, seconds: float, rng: random.Random) -> list[float]:
    """Arrival times (s from the first) of `count` requests of a Poisson process whose rate puts about
    `seconds` between the first and the last: exponential gaps of mean seconds / (count - 1). All 0 when
    seconds is 0 (at once)."""
    if seconds <= 0 or count < 2:
        return [0.0] * count
    offsets, at = [0.0], 0.0
    for _ in range(count - 1):
        at += rng.expovariate((count - 1) / seconds)
        offsets.append(at)
    return offsets


def cold_warm(probe: Probe, args: argparse.Namespace, words: PromptMaker, texts: list[str],
              seed: int = 10_000) -> tuple[dict, list[tuple[str, bytes]]]:
    """Cold, warm and follow-up per round (the first two rounds unmeasured: graphs and caches warm up);
    the images are made from seed on (another seed for another decoder: every cold image new to the
    encoder); a follow-up asks a new short question about the round's image."""
    salt = uuid.uuid4().hex[:16]
    cold, warm, follow, cold_splits, warm_splits, follow_splits, prompts = [], [], [], [], [], [], []
    first: dict[str, list[float]] = {"cold": [], "warm": [], "followup": []}  # the unmeasured rounds
    for i, text in enumerate(texts):
        prompt, png = words.image_prompt(text), random_png(seed + i, args.image_size)
        c, c_split = probe.ttft(prompt, png, salt)
        w, w_split = probe.ttft(prompt, png, salt)
        f, f_split = probe.ttft(words.image_prompt(words.text(args.followup_tokens)), png, salt)
        print(f"round {i}: cold {ms(c)} ms {c_split['decoder']}  warm {ms(w)} ms {w_split['decoder']}  "
              f"follow-up {ms(f)} ms", flush=True)
        if i < 2:  # a first request after the start pays what the decoder's warm-up did not compile
            for key, value in (("cold", c), ("warm", w), ("followup", f)):
                first[key].append(ms(value))
        else:
            cold.append(c), warm.append(w), cold_splits.append(c_split), warm_splits.append(w_split)
            follow.append(f), follow_splits.append(f_split)
            prompts.append((prompt, png))
    usage = probe.decoder.generate_text(prompts[0][0], [prompts[0][1]], max_tokens=1, cache_salt=salt).usage
    return {
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "cold": summary(cold), "warm": summary(warm),
        "cold_split_ms": mean_split(cold_splits, "decoder"),
        "cold_encoder_split_ms": mean_split(cold_splits, "encoder"),
        "cold_tower_gpu_ms": round(statistics.mean(s["encoder_tower_gpu_ms"] for s in cold_splits), 2),
        "warm_split_ms": mean_split(warm_splits, "decoder"),
        "followup": summary(follow), "followup_split_ms": mean_split(follow_splits, "decoder"),
        "cold_over_followup": round(statistics.median(cold) / statistics.median(follow), 2),
        "first_rounds_ms": first,
    }, prompts


async def _burst(address: str, jobs: list[tuple[str, bytes]], n: int, offsets: list[float]
                 ) -> tuple[list[float], float]:
    salt = uuid.uuid4().hex[:16]

    async def one(client: AsyncDecoderClient, prompt: str, png: bytes, offset: float) -> float:
        await asyncio.sleep(offset)  # its arrival (0: at once); the TTFT counts from there
        started, first = time.perf_counter(), float("nan")
        async for chunk in client.generate(prompt, [png], max_tokens=n, ignore_eos=True, cache_salt=salt):
            if first != first and chunk.token_ids:  # NaN until the first token
                first = time.perf_counter() - started
        return first

    async with AsyncDecoderClient(address, timeout=600) as client:
        started = time.perf_counter()
        ttfts = await asyncio.gather(*(one(client, p, png, at) for (p, png), at in zip(jobs, offsets,
                                                                                      strict=True)))
        return list(ttfts), time.perf_counter() - started


def burst(probe: Probe, args: argparse.Namespace, words: PromptMaker, single: dict,
          weight_bytes: int, seed: int = 20_000) -> dict:
    """--concurrency distinct one-image requests at once (or arriving over --arrival-seconds), against
    their roofline."""
    jobs = [(words.image_prompt(random_words(words.rng, args.burst_words)),
             random_png(seed + i, args.image_size)) for i in range(args.concurrency)]
    offsets = poisson_offsets(args.concurrency, args.arrival_seconds, random.Random(seed))
    before = probe.snapshot()
    since = time.monotonic()
    ttfts, wall = asyncio.run(_burst(probe.address, jobs, args.burst_tokens, offsets))
    until = time.monotonic()
    after = probe.snapshot()
    split = split_between(before, after)
    prompt_tokens = int(after["decoder"].get("prefix_cache_queried_tokens", 0)) - int(
        before["decoder"].get("prefix_cache_queried_tokens", 0))
    # The tower's device time in the burst counts the decoder's kernels sharing the GPU: the roofline
    # takes each image at its time alone instead.
    tower_s = args.concurrency * single["cold_tower_gpu_ms"] / 1000
    prefill_s = prompt_tokens * single["cold_split_ms"].get("prefill", 0.0) / 1000 / max(
        single["prompt_tokens"] or 1, 1)
    decode_s = args.burst_tokens * weight_bytes / COPY_BANDWIDTH
    roofline = tower_s + prefill_s + decode_s
    ttft = summary(ttfts)
    if args.arrival_seconds > 0:  # spread arrivals: the tail against the median
        ttft["p99_ms"] = ms(percentile(ttfts, 99))
        ttft["p99_over_p50"] = round(ttft["p99_ms"] / ttft["p50_ms"], 2) if ttft["p50_ms"] else None
    return {"ttft": ttft, "arrival_seconds": args.arrival_seconds,
            "arrivals_span_ms": ms(offsets[-1]) if offsets else 0.0, "wall_ms": ms(wall),
            "prompt_tokens": prompt_tokens,
            "tower_gpu_ms_in_burst": split["encoder_tower_gpu_ms"],
            "roofline_ms": ms(roofline),
            "roofline_parts_ms": {"tower_gpu": ms(tower_s), "prefill": ms(prefill_s), "decode": ms(decode_s)},
            "wall_over_roofline": round(wall / roofline, 2) if roofline else None,
            "split_ms": split["decoder"], "encoder_split_ms": split["encoder"],
            "engine_steps": summarize(read_trace(probe.trace, since, until), since, until)}


def lm_weight_bytes(model: str, dtype: str) -> int:
    """Bytes of the language model's weights read per decode step (safetensors sizes minus the tower's,
    scaled to dtype)."""
    from safetensors import safe_open

    total, itemsize = 0, 1 if "8" in dtype else 2
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if "visual" in name or "vision_tower" in name or "multi_modal_projector" in name:
                    continue
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n * itemsize
    return total


def hf_cold(args: argparse.Namespace, prompts: list[tuple[str, bytes]]) -> dict:
    """HF generate(max_new_tokens=1) on the cold prompts, its processor's work excluded: the class of the
    checkpoint's family (ModelFamily.hf_class), its input_ids from our tokenizer (tested equal to HF's
    processor's) and its pixel values from the checkpoint's HF image processor."""
    import io

    import torch
    import transformers
    from PIL import Image

    from bench.hf_ref import hf_image_processor
    from common.checkpoint import parse_dtype
    from common.families.registry import family_of_model
    from decoder_svc.tokenization import PromptTokenizer

    device = torch.device(args.device)
    family = family_of_model(args.model)
    # Placed on the device as it loads (weights the checkpoint lacks, e.g. Phi-4's LoRA-wrapped base
    # layers, are then initialised there rather than on the host).
    placement = {"device_map": str(device)} if device.type == "cuda" else {}
    model = getattr(transformers, family.hf_class).from_pretrained(
        args.model, dtype=parse_dtype(args.dtype), **placement).to(device).eval()
    layout = family.image_layout(args.model, load_config(args.model))
    processor = hf_image_processor(args.model)
    tok = PromptTokenizer(args.model)
    times = []
    for i, (prompt, png) in enumerate([prompts[0], *prompts]):  # the first one again: warm-up
        out = processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
        if "image_pixel_values" in out:  # Phi-4-multimodal: HD crops, their mask and the image's size
            inputs = {"image_pixel_values": out["image_pixel_values"].to(device, model.dtype),
                      "image_attention_mask": out["image_attention_mask"].to(device, model.dtype),
                      "image_sizes": out["image_sizes"].to(device)}
            count = int(out["num_img_tokens"][0])
        else:
            inputs = {"pixel_values": out["pixel_values"].to(device, model.dtype)}
        if "image_grid_thw" in out:  # the Qwen families: the grid sets the token count
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            count = layout.num_tokens(grid)
            inputs["image_grid_thw"] = out["image_grid_thw"].to(device)
        elif "num_img_tokens" not in out:
            count = layout.num_tokens()
        ids = tok.encode_prompt(prompt, image_token_counts=[count]).token_ids
        input_ids = torch.tensor([ids], device=device)
        inputs.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        image_mask = (input_ids == tok.image_token_id).int()
        if "image_grid_thw" in out:
            inputs["mm_token_type_ids"] = image_mask
        elif layout.bidirectional_images:  # Gemma 3: HF's image block mask reads token_type_ids
            inputs["token_type_ids"] = image_mask.long()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        if i:
            times.append(time.perf_counter() - started)
    return summary(times)


def start_services(args: argparse.Namespace) -> tuple[Service, dict[str, tuple[Service, Path]]]:
    """The encoder and, per --transports entry (or one with the decoder's default), a decoder with its
    step trace; all started at once."""
    logs = workdir(args.logs)
    transports = args.transports.split(",") if args.transports else [""]
    enc_args = args.encoder_args.split()
    if "nixl" in transports and "--nixl" not in enc_args:
        enc_args.append("--nixl")
    encoder = encoder_service(args.model, logs, args.device, args.dtype, enc_args)
    decoders = {}
    for t in transports:
        name = f"decoder-{t}" if t else "decoder"
        extra = args.decoder_args.split() + (["--embedding-transports", t] if t else [])
        trace = logs / f"{name}-steps.jsonl"
        service = decoder_service(args.model, encoder.address, logs, args.device, args.dtype,
                                  [*extra, "--step-trace", str(trace)], name=name)
        decoders[t or "default"] = (service, trace)
    start_all([encoder, *(d for d, _ in decoders.values())])
    return encoder, decoders


def measure(probe: Probe, args: argparse.Namespace, words: PromptMaker, texts: list[str],
            index: int) -> tuple[dict, list[tuple[str, bytes]]]:
    """Cold/warm rounds, then the burst (--concurrency), on one decoder; its images are its own."""
    before = probe.snapshot()["decoder"].get("embedding_transports", {})
    out: dict = {}
    out["single"], prompts = cold_warm(probe, args, words, texts, seed=10_000 + 1000 * index)
    after = probe.snapshot()["decoder"].get("embedding_transports", {})
    # How the cold rounds' embeddings came (e.g. to check an --embedding-transports choice held).
    out["single"]["embedding_transports"] = {
        k: int(v) - int(before.get(k, 0)) for k, v in after.items() if int(v) != int(before.get(k, 0))}
    if index == 0:  # what the same requests' crossing costs a bare gRPC server on this host
        out["single"]["crossing_floor"] = crossing_floor(
            [generate_request(prompt, [png], max_tokens=1, ignore_eos=True) for prompt, png in prompts])
    print("single", out["single"], flush=True)
    if args.concurrency:
        weights = lm_weight_bytes(args.model, args.dtype)
        out["burst"] = burst(probe, args, words, out["single"], weights, seed=20_000 + 1000 * index)
        print("burst", out["burst"], flush=True)
    return out, prompts


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints each part as it finishes and saves the result as `ttft`."""
    args = build_arg_parser().parse_args(argv)
    words = PromptMaker(args.model, seed=1)
    texts = [words.text(args.text_tokens) for _ in range(args.rounds + 2)]
    result: dict = {"model": load_config(args.model).get("model_type")}
    encoder, decoders = start_services(args)
    try:
        for index, (label, (decoder, trace)) in enumerate(decoders.items()):
            print(f"== decoder {label}", flush=True)
            measured, prompts = measure(Probe(decoder, encoder, trace), args, words, texts, index)
            if label == "default":
                result.update(measured)
            else:
                result.setdefault("by_transport", {})[label] = measured
    finally:
        for decoder, _ in decoders.values():
            decoder.stop()
        encoder.stop()
    if "by_transport" in result:
        result["cold_p50_ms_by_transport"] = {
            t: m["single"]["cold"]["p50_ms"] for t, m in result["by_transport"].items()}
        print("cold p50 by transport", result["cold_p50_ms_by_transport"], flush=True)
    if args.hf:
        result["hf_cold"] = hf_cold(args, prompts)
        first = result.get("single") or next(iter(result["by_transport"].values()))["single"]
        result["cold_over_hf"] = round(first["cold"]["p50_ms"] / result["hf_cold"]["p50_ms"], 3)
        print("hf", result["hf_cold"], flush=True)
    save_result("ttft", args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
