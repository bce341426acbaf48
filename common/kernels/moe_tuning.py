"""Which way a MoE layer's experts run on the GPU, measured rather than guessed: the Triton tiling of a
decode batch (`choose_config`: the fastest of DECODE_CONFIGS for the batch's shapes) and, for a prefill,
the Triton tiling or torch's grouped GEMM (`prefill_backend`). `moe_experts` is what the layer calls: the
choice, then fused_moe.py's kernels or moe_grouped_mm.py's path. Choices are made once per shape and
process, never inside a CUDA graph capture; `tuning_summary` lists them for the benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import asdict, dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from common.kernels import moe_grouped_mm
from common.kernels.fused_moe import GemmConfig, combine, default_config, fused_moe
from common.kernels.graph_timing import event_time_us, graph_time_us
from common.kernels.moe_gemv import GemvConfig, gemv_moe, routed_gemv_moe
from common.kernels.moe_route import route_topk
from common.kernels.moe_stream_gemv import CONFIGS as STREAM_CONFIGS
from common.kernels.moe_stream_gemv import StreamMoeConfig, stream_moe
from common.kernels.moe_stream_gemv import usable as stream_usable

log = logging.getLogger("mmserve.decoder.fused_moe")


def routed_experts(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                   gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a MoE layer calls on the GPU: its routed experts' weighted sum for x [T, H] from the router's
    logits [T, experts]. A batch whose measured choice is the GEMVs routes inside them
    (moe_gemv.routed_gemv_moe); any other takes the router kernel (moe_route.route_topk), then
    moe_experts."""
    if 0 < x.shape[0] <= GEMV_TOKENS:
        config = choose_config(x, gate_up, down, top_k, gate_up_scale, down_scale)
        if isinstance(config, GemvConfig):
            return routed_gemv_moe(x, logits, top_k, renormalize, gate_up, down, config, gate_up_scale,
                                   down_scale)
    weights, ids = route_topk(logits, top_k, renormalize)
    return moe_experts(x, gate_up, down, weights, ids, gate_up_scale, down_scale)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe's contract (x [T, H] through the experts, combined), the tiling or path chosen here: a
    prefill that prefill_backend sends to torch's grouped GEMM takes it, anything else the Triton kernels
    with choose_config's tiling."""
    tokens, top_k = topk_ids.shape
    if tokens and prefill_backend(x, gate_up, down, top_k) == "grouped_mm":
        rows = moe_grouped_mm.grouped_mm_rows(x, gate_up, down, topk_weights, topk_ids)
        return combine(rows, tokens, top_k)
    config = choose_config(x, gate_up, down, top_k, gate_up_scale, down_scale)
    return run_experts(x, gate_up, down, topk_weights, topk_ids, config, gate_up_scale, down_scale)


Config = GemmConfig | GemvConfig | StreamMoeConfig  # a path and its tiling


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, config: Config, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe's contract through `config`'s path: the per-assignment GEMVs (moe_gemv.py) for a
    GemvConfig, the same through TMA (moe_stream_gemv.py) for a StreamMoeConfig, the sort and grouped
    GEMM (fused_moe.py) for a GemmConfig."""
    if isinstance(config, GemvConfig):
        return gemv_moe(x, gate_up, down, topk_weights, topk_ids, config, gate_up_scale, down_scale)
    if isinstance(config, StreamMoeConfig):
        return stream_moe(x, gate_up, down, topk_weights, topk_ids, config, gate_up_scale, down_scale)
    return fused_moe(x, gate_up, down, topk_weights, topk_ids, config, gate_up_scale, down_scale)


# Decode batches (up to TUNED_TOKENS tokens) take the fastest of these tilings for their shapes, measured
# once per MoeKey (`choose_config`; one tiling serves both products, the sort's blocks being shared). At
# one token each chosen expert is a GEMV whose speed is the share of the SMs its programs keep streaming:
# the N tile and the K depth decide it, and the best differs with the experts' shapes and between cards,
# so it is measured, not guessed.
TUNED_TOKENS = 64
DECODE_CONFIGS = (
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),
    GemmConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3),
    GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3),
    GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=6),
    GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4),
    GemmConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4),
    # the weight tile as the MMA's left operand: a block's few rows are the narrow side
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, swap_ab=True),
    GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, swap_ab=True),
    GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, swap_ab=True),
)
# Batches of up to GEMV_TOKENS tokens also try one GEMV per assignment without a sort (moe_gemv.py): at a
# token or two it streams the chosen experts with many small programs; beyond, assignments that share an
# expert read it again, and the measurement says where that stops paying.
GEMV_TOKENS = 8
GEMV_CONFIGS = (
    GemvConfig(block_n=16, block_k=256, num_warps=4),
    GemvConfig(block_n=8, block_k=256, num_warps=4),
    GemvConfig(block_n=32, block_k=128, num_warps=4),
    GemvConfig(block_n=16, block_k=512, num_warps=8),
    GemvConfig(block_n=8, block_k=256, num_warps=4, fuse_combine=True),
    GemvConfig(block_n=4, block_k=256, num_warps=2, fuse_combine=True),
)
TIMING_ROUTINGS = 8  # distinct random routings a timing rotates over, so weights stream from memory


@dataclass(frozen=True)
class MoeKey:
    """What a tiling is chosen for: the batch's tokens (rounded up to a power of two) and the layer's
    expert shapes and dtypes."""

    tokens: int
    top_k: int
    experts: int
    hidden: int
    width: int
    dtype: torch.dtype
    weight_dtype: torch.dtype


@dataclass(frozen=True)
class MoeChoice:
    """The chosen tiling and every candidate's time (us per MoE call from the router's logits: route,
    sort, both products and combine, or the GEMVs and combine)."""

    config: Config
    times_us: dict[Config, float]


CHOICES: dict[MoeKey, MoeChoice] = {}  # one per process: the shapes are the model's


def choose_config(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                  gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None) -> Config:
    """The tiling moe_experts launches for x [T, H] through these experts: default_config's beyond
    TUNED_TOKENS tokens; else the fastest of DECODE_CONFIGS (and up to GEMV_TOKENS tokens of
    GEMV_CONFIGS and, on Hopper, moe_stream_gemv's CONFIGS) that computes what DECODE_CONFIGS[0]
    computes (to bf16 rounding, on the first routing), measured once per MoeKey as decode runs it
    (the sort and both products over TIMING_ROUTINGS random routings of the key's tokens, back to back in
    a replayed CUDA graph: graph_timing.graph_time_us; a second or so per key, the first time also
    Triton's compiles). Never measured inside a graph capture (the runner runs every graph's batch once
    before capturing it, so keys are measured before SERVING): an unmeasured key there takes
    default_config. Without graphs (--enforce-eager) a key is measured when its batch size first runs."""
    if x.shape[0] > TUNED_TOKENS or not x.is_cuda:
        return default_config(x.shape[0])
    tokens = triton.next_power_of_2(x.shape[0])
    key = MoeKey(tokens, top_k, gate_up.shape[0], gate_up.shape[2], down.shape[2], x.dtype, gate_up.dtype)
    if key in CHOICES:
        return CHOICES[key].config
    if torch.cuda.is_current_stream_capturing():
        return default_config(tokens)
    gen = torch.Generator(device=x.device).manual_seed(tokens)
    # random router logits: each routing spreads the tokens over the experts, as trained routers do
    routings = [torch.randn(tokens, key.experts, generator=gen, device=x.device).to(x.dtype)
                for _ in range(TIMING_ROUTINGS)]
    rows = torch.randn(tokens, key.hidden, generator=gen, device=x.device).to(x.dtype)

    def experts(logits: torch.Tensor, config: Config) -> torch.Tensor:
        # from the logits, as routed_experts runs each path (the GEMVs route themselves)
        if isinstance(config, GemvConfig):
            return routed_gemv_moe(rows, logits, top_k, True, gate_up, down, config, gate_up_scale,
                                   down_scale)
        weights, ids = route_topk(logits, top_k, True)
        return run_experts(rows, gate_up, down, weights, ids, config, gate_up_scale, down_scale)

    candidates = DECODE_CONFIGS
    if tokens <= GEMV_TOKENS:
        candidates += GEMV_CONFIGS + (STREAM_CONFIGS if stream_usable(x, gate_up, down) else ())
    reference = experts(routings[0], DECODE_CONFIGS[0]).float()
    times = {}
    for config in candidates:
        try:
            if not _agrees(experts(routings[0], config).float(), reference):
                log.warning("fused MoE, %d tokens: %s disagrees with %s; not a candidate", tokens,
                            config_name(config), config_name(DECODE_CONFIGS[0]))
                continue
            times[config] = graph_time_us([functools.partial(experts, logits, config) for logits in routings])
        except OutOfResources:  # a tiling this card's shared memory cannot hold (the first always fits)
            continue
        except Exception as e:  # noqa: BLE001 - a candidate this card or build cannot compile or launch
            if config == DECODE_CONFIGS[0]:
                raise
            log.warning("fused MoE, %d tokens: %s failed (%s); not a candidate", tokens, config_name(config),
                        str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
    best = min(times, key=times.get)
    CHOICES[key] = MoeChoice(best, times)
    log.info("fused MoE, %d tokens x top-%d of %d experts (%dx%d, %s): %s (%.1f us; default %.1f)",
             tokens, top_k, key.experts, key.hidden, key.width, str(key.weight_dtype).removeprefix("torch."),
             config_name(best), times[best], times.get(DECODE_CONFIGS[0], float("nan")))
    return best


def _agrees(got: torch.Tensor, reference: torch.Tensor) -> bool:
    # the same function to a few bf16 roundings (products summed in other orders), not a broken kernel
    return bool(torch.isfinite(got).all()) and (got - reference).norm() <= 1e-2 * reference.norm() + 1e-6


def config_name(config: Config) -> str:
    """A tiling's short name in logs and the benchmarks' JSON."""
    if isinstance(config, GemvConfig | StreamMoeConfig):
        return config.name
    swap = "+swap" if config.swap_ab else ""
    return f"{config.block_m}x{config.block_n}x{config.block_k}/{config.num_warps}w{config.num_stages}s{swap}"


def tuning_summary() -> list[dict]:
    """The measured choices as JSON rows (benchmarks put them beside their figures): decode tilings, then
    prefill paths."""
    def shape(k: MoeKey) -> dict:
        return {"tokens": k.tokens, "top_k": k.top_k, "experts": k.experts, "hidden": k.hidden,
                "width": k.width, "weight_dtype": str(k.weight_dtype).removeprefix("torch.")}

    decode = [{**shape(k), "chosen": {"name": config_name(c.config), **asdict(c.config)},
               "times_us": {config_name(g): round(t, 2) for g, t in c.times_us.items()}}
              for k, c in CHOICES.items()]
    prefill = [{**shape(k), "chosen": c.backend,
                "times_us": {b: round(t, 2) for b, t in c.times_us.items()}}
               for k, c in PREFILL_CHOICES.items()]
    return decode + prefill


# Prefill batches (more than TUNED_TOKENS tokens, outside CUDA graphs) may take torch's grouped GEMM
# (moe_grouped_mm.py: no padding, CUTLASS's kernels on Hopper) instead of default_config's tiling: each
# size (rounded up to a power of two) takes the faster of the two, measured once (`prefill_backend`).
# MMSERVE_MOE_PREFILL=triton or grouped_mm fixes the choice (the A/B of the benchmarks).
PREFILL_ENV = "MMSERVE_MOE_PREFILL"
PREFILL_BACKENDS = ("auto", "triton", "grouped_mm")


@dataclass(frozen=True)
class PrefillChoice:
    """The path a prefill size takes and each path's time (us per MoE call)."""

    backend: str
    times_us: dict[str, float]


PREFILL_CHOICES: dict[MoeKey, PrefillChoice] = {}  # one per process: the shapes are the model's


def prefill_backend(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> str:
    """"triton" or "grouped_mm" for x [T, H] through these experts: "triton" for decode sizes (up to
    TUNED_TOKENS tokens), off a GPU, inside a graph capture, and for experts the grouped GEMM does not take
    (FP8); else MMSERVE_MOE_PREFILL's fixed choice, or (auto) the faster of the two for T rounded up to a
    power of two, timed once eagerly over a few random routings, every smaller power of two above
    TUNED_TOKENS with it (a grouped GEMM that fails here, e.g. a layout this torch build refuses, leaves
    the size on "triton")."""
    mode = os.environ.get(PREFILL_ENV, "auto")
    if mode not in PREFILL_BACKENDS:
        raise ValueError(f"{PREFILL_ENV}={mode!r}: expected one of {', '.join(PREFILL_BACKENDS)}")
    if (x.shape[0] <= TUNED_TOKENS or not x.is_cuda or torch.cuda.is_current_stream_capturing()
            or not moe_grouped_mm.supported(x, gate_up)):
        return "triton"
    if mode != "auto":
        return mode
    tokens = triton.next_power_of_2(x.shape[0])
    key = MoeKey(tokens, top_k, gate_up.shape[0], gate_up.shape[2], down.shape[2], x.dtype, gate_up.dtype)
    if key not in PREFILL_CHOICES:
        # every smaller prefill size too: the start-up's largest prefill measures them all, so a user's
        # first prompt of another length finds its size measured
        size = 2 * TUNED_TOKENS
        while size <= tokens:
            smaller = dataclasses.replace(key, tokens=size)
            if smaller not in PREFILL_CHOICES:
                PREFILL_CHOICES[smaller] = _measure_prefill(smaller, x.device, gate_up, down)
            size *= 2
    return PREFILL_CHOICES[key].backend


def _measure_prefill(key: MoeKey, device: torch.device, gate_up: torch.Tensor,
                     down: torch.Tensor) -> PrefillChoice:
    gen = torch.Generator(device=device).manual_seed(key.tokens)
    routings = [torch.rand(key.tokens, key.experts, generator=gen, device=device).topk(key.top_k, dim=-1)
                .indices for _ in range(3)]
    weights = torch.full((key.tokens, key.top_k), 1.0 / key.top_k, dtype=key.dtype, device=device)
    rows = torch.randn(key.tokens, key.hidden, generator=gen, device=device).to(key.dtype)
    config = default_config(key.tokens)
    times = {"triton": event_time_us([functools.partial(fused_moe, rows, gate_up, down, weights, ids, config)
                                      for ids in routings])}
    try:
        times["grouped_mm"] = event_time_us([
            functools.partial(moe_grouped_mm.grouped_mm_rows, rows, gate_up, down, weights, ids)
            for ids in routings])
    except RuntimeError as e:
        log.warning("fused MoE, %d tokens: torch's grouped GEMM failed (%s); the Triton tiling serves",
                    key.tokens, e)
        return PrefillChoice("triton", times)
    backend = min(times, key=times.get)
    log.info("fused MoE prefill, %d tokens x top-%d of %d experts (%dx%d): %s (triton %.1f us, grouped_mm "
             "%.1f us)", key.tokens, key.top_k, key.experts, key.hidden, key.width, backend,
             times["triton"], times["grouped_mm"])
    return PrefillChoice(backend, times)


