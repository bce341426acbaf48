"""Which GPU kernel each layer takes: the Triton side of the decoder's kernels (backends.make_kernels picks
it on CUDA), above the kernels themselves (common/kernels, which know nothing of the model).

- `TritonOps`: TorchOps' signatures over the Triton kernels. `norm_linear`, `act_linear` and `linear`
  take one kernel for a one-row product where start-up timing found it faster than the separate op and
  cuBLAS (common/kernels/decode_gemv.py; `GemvChoices` records the measurements, `MMSERVE_DECODE_GEMV`
  forces a side); their new residual is then a new tensor rather than `residual` written in place. The
  separate path's product is `linear`'s choice (on Hopper the TMA-streamed GEMV against cuBLAS).
  `fp8_linear` keeps fp32 activations on the reference path; `lora_add` picks the per-row kernels or
  the stacked GEMMs by row count.
- `TritonAttentionBackend`: the attention backend over common/kernels/attention.py, choosing how many
  programs split each sequence's keys and whether a decode step rotates inside the attention kernel.
- `InvariantTritonOps`, `InvariantTritonAttentionBackend`: the deterministic mode's
  (model/batch_invariant.py).

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests), so the kernels are imported at the top.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import triton
from torch import nn

from common.kernels import decode_gemv as gemv
from common.kernels import elementwise
from common.kernels.attention import DecodeRotary, paged_attention, row_tiles
from common.kernels.decode_gemv import PROLOGUE_NAMES, GemvWeight
from common.kernels.elementwise import RotaryLaunch
from common.kernels.graph_timing import copy_count, graph_time_us
from common.kernels.kv_store import rotary_store_kv, store_kv
from decoder_svc.model.attention import AttentionBackend, AttentionMetadata, Rotary
from decoder_svc.model.lora.batched import LoRASlots, idle_base
from decoder_svc.model.ops import TorchOps
from decoder_svc.model.quant.fp8 import ScaleBlock

log = logging.getLogger("mmserve.decoder.gemv")

MODE_ENV = "MMSERVE_DECODE_GEMV"  # auto (measure), on, off
ROTATE_ENV = "MMSERVE_ROTATE_IN_ATTENTION"


class TritonOps:
    """Triton kernels with TorchOps' signatures; rms_norm(residual) and rotary write in place."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rmsnorm(h), h) with h = x, or h = x + residual written IN PLACE into residual.

        weight must have x's dtype (the model casts its parameters), so out has x's dtype as in HF.
        x is never modified; the returned residual is `x` or the `residual` tensor itself.
        """
        return elementwise.rms_norm(x, weight, eps, residual, unit_offset=False)

    @staticmethod
    def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's norm (TorchOps.offset_rms_norm: (1 + weight) in fp32, one rounding) in one kernel; the
        residual as rms_norm's (written IN PLACE)."""
        return elementwise.rms_norm(x, weight, eps, residual, unit_offset=True)

    @staticmethod
    def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """TorchOps.qk_norm in one launch (each head rounded as rms_norm rounds a row), reading the heads
        where the qkv product left them."""
        return elementwise.qk_rms_norm(q, k, q_weight, k_weight, eps, unit_offset)

    @staticmethod
    def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = cat(gate, up) -> new tensor gelu_tanh(gate) * up [T, I] (Gemma's MLP)."""
        return elementwise.gated_act(x, gelu=True)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = cat(gate, up) -> new tensor silu(gate) * up [T, I]; x is not modified."""
        return elementwise.gated_act(x, gelu=False)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE applied IN PLACE to q [T, Hq, D] and k [T, Hk, D]; returns (q, k). Partial
        rotary: a cos_sin_cache R < D wide rotates the first R dims of each head only.

        q and k may be arbitrary strided views (e.g. of one fused qkv buffer) but must not overlap.
        Positions are not bounds-checked against the cache (a check would force a host sync).
        """
        return elementwise.rotary(q, k, positions, cos_sin_cache)

    @staticmethod
    def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """TorchOps.norm_linear: one fused kernel for one row where it was measured faster."""

        def separate(x, residual, proj):
            h, new_residual = TritonOps.rms_norm(x, weight, eps, residual)
            return TritonOps.linear(h, proj), new_residual

        proj = idle_base(proj)
        w = _one_row_weight(x, proj)
        if w is not None:
            key = GemvKey.of(w, gemv.RMS_NORM, residual is not None)
            if _tunable(key):  # on scratch copies: the separate path writes its residual in place
                xs, rs, projs = x.clone(), None if residual is None else residual.clone(), copies(proj)
                fused = [partial(gemv.fused_gemv, xs, gemv_weight(p), gemv.RMS_NORM, rs, weight, eps)
                         for p in projs]
                CHOICES.tune(key, fused, [partial(separate, xs, rs, p) for p in projs])
            if CHOICES.use_fused(key):
                return gemv.fused_gemv(x, w, gemv.RMS_NORM, residual, weight, eps)
        return separate(x, residual, proj)

    @staticmethod
    def act_linear(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """TorchOps.act_linear: one fused kernel for one row where it was measured faster."""

        def separate(proj):
            return TritonOps.linear(TritonOps.silu_and_mul(x), proj)

        proj = idle_base(proj)
        w = _one_row_weight(x, proj)
        if w is not None:
            key = GemvKey.of(w, gemv.SILU_MUL, False)
            if _tunable(key):
                projs = copies(proj)
                CHOICES.tune(key, [partial(gemv.fused_gemv, x, gemv_weight(p), gemv.SILU_MUL) for p in projs],
                               [partial(separate, p) for p in projs])
            if CHOICES.use_fused(key):
                return gemv.fused_gemv(x, w, gemv.SILU_MUL)[0]
        return separate(proj)

    @staticmethod
    def linear(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """TorchOps.linear: the one-row kernel where it was measured faster than the module's product."""
        proj = idle_base(proj)
        w = _one_row_weight(x, proj)
        if w is not None:
            key = GemvKey.of(w, gemv.PLAIN, False)
            if _tunable(key):
                projs = copies(proj)
                CHOICES.tune(key, [partial(gemv.fused_gemv, x, gemv_weight(p)) for p in projs],
                               [partial(p, x) for p in projs])
            if CHOICES.use_fused(key):
                return gemv.fused_gemv(x, w)[0]
        return proj(x)

    @staticmethod
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """TorchOps.fp8_linear on the GPU: weight-only FP8 kernels at small batches, FP8 tensor-core
        products at large ones (common/kernels/fp8_linear.py); fp32 activations take the reference path."""
        if x.dtype not in (torch.bfloat16, torch.float16):
            return TorchOps.fp8_linear(x, weight, scale, block, bias)
        from common.kernels.fp8_linear import fp8_linear

        return fp8_linear(x, weight, scale, block, bias)

    @staticmethod
    def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 rows: LoRASlots, rank: int) -> torch.Tensor:
        """TorchOps.lora_add on the GPU (common/kernels/lora.py: two Triton kernels for a few rows, two
        stacked GEMMs for more), into y in place."""
        from common.kernels.lora import GATHER_MAX_ROWS, lora_add_triton

        x = x.contiguous()
        adapter_rows = rows.adapter_rows(x.dtype) if x.shape[0] > GATHER_MAX_ROWS else None
        return lora_add_triton(y, x, lora_a, lora_b, rows.slots, rank, adapter_rows)

    @staticmethod
    def make_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
        """Same fp32 [max_positions, D] cos|sin table as TorchOps (built once at load, no kernel needed)."""
        return TorchOps.make_cos_sin_cache(inv_freq, max_positions)


def _one_row_weight(x: torch.Tensor, proj: nn.Module) -> GemvWeight | None:
    # The one-row kernels take a single half-precision activation row on the GPU (a LoRA-wrapped
    # projection only in a forward without adapters: idle_base is then its base).
    if x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
        return None
    return gemv_weight(proj)


def _tunable(key: GemvKey) -> bool:
    # Measure each key once, never inside a CUDA graph capture (timing synchronises).
    return (CHOICES.mode == "auto" and key not in CHOICES.timings
            and not torch.cuda.is_current_stream_capturing())


def gemv_weight(proj: nn.Module) -> GemvWeight | None:
    """The projection's weight as the kernel takes it, or None (block-scaled FP8, odd layouts)."""
    weight = getattr(proj, "weight", None)
    if weight is None or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    scale = getattr(proj, "weight_scale", None)
    if scale is not None:
        block = proj.block
        if not block.is_per_channel(weight.shape[1]):
            return None
        scale = scale.reshape(-1)
    elif weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return GemvWeight(weight, scale, proj.bias)


@dataclass(frozen=True)
class GemvKey:
    """What a choice is made for: a weight shape and dtype, the fused op, with or without a residual."""

    n: int
    k: int
    dtype: torch.dtype
    scaled: bool
    prologue: int
    residual: bool

    @classmethod
    def of(cls, w: GemvWeight, prologue: int, residual: bool) -> GemvKey:
        """The key of one call."""
        n, k = w.weight.shape
        return cls(n, k, w.weight.dtype, w.scale is not None, prologue, residual)


@dataclass(frozen=True)
class GemvTiming:
    """One start-up measurement: microseconds of the fused kernel and of the separate op + product."""

    key: GemvKey
    fused_us: float
    unfused_us: float

    @property
    def fused_wins(self) -> bool:
        """True when the fused kernel was faster."""
        return self.fused_us < self.unfused_us


class GemvChoices:
    """Which calls take the fused kernel: measured per key (`tune`), or forced by MMSERVE_DECODE_GEMV."""

    def __init__(self, mode: str | None = None) -> None:
        mode = (mode or os.environ.get(MODE_ENV, "auto")).lower()
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"{MODE_ENV} must be auto, on or off, got {mode!r}")
        self.mode = mode
        self.timings: dict[GemvKey, GemvTiming] = {}

    def use_fused(self, key: GemvKey) -> bool:
        """The decision for a call (unmeasured keys in auto mode take the unfused path)."""
        if self.mode != "auto":
            return self.mode == "on"
        timing = self.timings.get(key)
        return timing is not None and timing.fused_wins

    def tune(self, key: GemvKey, fused: list[Callable[[], object]],
             separate: list[Callable[[], object]]) -> GemvTiming:
        """Time both sides of one key once (CUDA only; never while a graph is being captured). Each side
        is a list of calls over copies of the weight (`copies`), timed as decode runs them: back to back
        in one CUDA graph, the weights not in L2."""
        if key not in self.timings:
            timing = GemvTiming(key, graph_time_us(fused), graph_time_us(separate))
            self.timings[key] = timing
            log.info("decode GEMV %dx%d %s%s: fused %.1f us, separate %.1f us -> %s", key.n, key.k,
                     PROLOGUE_NAMES[key.prologue], " +residual" if key.residual else "", timing.fused_us,
                     timing.unfused_us, "fused" if timing.fused_wins else "separate")
        return self.timings[key]

    def summary(self) -> list[dict]:
        """The measurements as JSON rows (benchmarks put them beside their figures)."""
        return [{"n": t.key.n, "k": t.key.k, "dtype": str(t.key.dtype).removeprefix("torch."),
                 "fp8_scaled": t.key.scaled, "op": PROLOGUE_NAMES[t.key.prologue],
                 "residual": t.key.residual, "fused_us": t.fused_us, "separate_us": t.unfused_us,
                 "fused": t.fused_wins} for t in self.timings.values()]


def copies(proj: nn.Module) -> list[nn.Module]:
    """proj and `copy_count` - 1 copies of it."""
    nbytes = sum(p.numel() * p.element_size() for p in proj.parameters())
    return [proj] + [copy.deepcopy(proj) for _ in range(copy_count(nbytes, proj.weight.device) - 1)]


CHOICES = GemvChoices()  # one per process: the shapes are the model's, the timings the GPU's


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: one rotary + KV-store launch and one attention launch (plus a merge when
    the keys are split) per layer, the first folded into the second on decode steps, with no host
    synchronisation, so decode steps can be CUDA-graphed."""

    supports_cuda_graphs = True
    supports_sliding_window = True

    def __init__(self, num_sms: int | None = None, rotate_in_attention: bool | None = None) -> None:
        """rotate_in_attention: decode steps rotate and store in the attention kernel (DecodeRotary);
        default on, `MMSERVE_ROTATE_IN_ATTENTION=0` off (the A/B of bench.profile_step)."""
        if num_sms is None and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.num_sms = num_sms or 1
        if rotate_in_attention is None:
            rotate_in_attention = os.environ.get(ROTATE_ENV, "1") != "0"
        self.rotate_in_attention = rotate_in_attention

    def num_splits(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        """Split the keys when the batch's (query block, KV head) programs fill less than one wave of
        the GPU: decode batches of few sequences, and short chunks over a long cached prefix (the last
        tokens of a prompt after a prefix hit: without a split, a handful of programs would each walk
        the whole prefix). 16 at most. A chunk's blocks are counted as if its tokens were one sequence:
        the count must not depend on how a CUDA graph's padding is laid out."""
        kv_heads = kv_cache.shape[3]
        if meta.max_query_len == 1:
            blocks = meta.num_seqs
        else:
            _, block_q = row_tiles(meta.max_query_len, q.shape[1] // kv_heads)
            blocks = -(-q.shape[0] // block_q)
        programs = blocks * kv_heads
        if programs >= self.num_sms:
            return 1
        return min(16, triton.next_power_of_2(-(-self.num_sms // programs)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)  # first: key limits may reach this step's keys
        return paged_attention(q, kv_cache, meta, scale, self.num_splits(q, kv_cache, meta), window=window)

    def rotate_and_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                           positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """Decode steps: the attention kernel rotates q and k and stores K/V itself (DecodeRotary, one
        launch). Other steps: one kernel rotates q and k and stores K/V (kv_store.rotary_store_kv), then
        attention. Either way TritonOps.rotary's rounding, whatever `rotary` is, and k is left
        unrotated (the cache has the keys). Heads whose dims are strided take rotary, then forward."""
        if not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            return super().rotate_and_forward(q, k, v, rotary, positions, cos_sin, kv_cache, meta, scale,
                                              window)
        splits = self.num_splits(q, kv_cache, meta)
        if self.rotate_in_attention and DecodeRotary.applies(q, k, v, cos_sin, meta):
            decode = DecodeRotary(k, v, meta.slot_mapping, RotaryLaunch.of(q, k, positions, cos_sin))
            return paged_attention(q, kv_cache, meta, scale, splits, window=window, rotary=decode)
        rotary_store_kv(q, k, v, positions, cos_sin, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, scale, splits, window=window)


class InvariantTritonOps(TritonOps):
    """TritonOps for the deterministic mode (model/batch_invariant.py): no one-row kernels (a decode row
    would sum in another order than a prefill row), every product through the model's matmul (the mode
    sends it to the invariant kernel), LoRA through the reference's products (the gathering kernels split
    by the row count)."""

    batch_invariant = True  # layers with a kernel of their own (model/moe.py) take the reference instead

    # TorchOps' two-step forms over this class's (Triton) norm and activation, and its plain product
    norm_linear = classmethod(TorchOps.norm_linear.__func__)
    act_linear = classmethod(TorchOps.act_linear.__func__)
    linear = staticmethod(TorchOps.linear)

    @staticmethod
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError("the deterministic mode does not serve FP8 projections")

    lora_add = staticmethod(TorchOps.lora_add)  # products per slot over every row: the mode's kernel


class InvariantTritonAttentionBackend(TritonAttentionBackend):
    """The Triton attention in its invariant setting (paged_attention's `invariant`): one row tile, keys
    never split, decode steps rotated and stored by the KV-store kernel as prefill's are."""

    def __init__(self) -> None:
        super().__init__(rotate_in_attention=False)

    def num_splits(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        return 1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, scale, window=window, invariant=True)

    def rotate_and_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                           positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        if not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            return AttentionBackend.rotate_and_forward(self, q, k, v, rotary, positions, cos_sin, kv_cache,
                                                       meta, scale, window)
        rotary_store_kv(q, k, v, positions, cos_sin, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, scale, window=window, invariant=True)
