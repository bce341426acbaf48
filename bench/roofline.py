"""The roofline of a serving workload: the least time the device could take for the same work.

    roofline_s = (prefill FLOPs + vision FLOPs) / peak FLOP/s + decode bytes / copy bandwidth

- prefill: every request's prompt tokens (text and image) through the language model, 2 FLOPs per
  parameter per token plus causal attention (2 x layers x query width x n^2 for n tokens), and the
  output head once per request. Prefix reuse is not subtracted: the roofline is of the work as asked.
- vision: each distinct image once through the tower (the encoder's cache makes a repeat free),
  2 FLOPs per tower parameter per patch; the tower's attention is left out (under 10% at these sizes).
- decode: every step reads the language model's weights once, and each running sequence's KV cache;
  with `concurrency` sequences at a time, ceil(requests / concurrency) x (output_len - 1) steps. A
  mixture of experts counts its active parameters per token (attention, router, top_k experts) for the
  FLOPs; a decode step of b sequences reads the experts b tokens hit, expected under uniform routing
  (`expected_experts`).
- peak: the dense bf16 figure of the GPU's data sheet where known (H100/H200 SXM: 989.4 TFLOP/s),
  else a measured large matmul in the served dtype (e.g. on a CPU); bandwidth: bench.bandwidth's
  measured copy.

Everything comes from the checkpoint's config.json (shapes) and its safetensors headers (the tower's
parameter count), read without loading a weight.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.bandwidth import copy_bandwidth
from common.checkpoint import load_config, parse_dtype, safetensors_files
from decoder_svc.model.config import TextModelConfig

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, by device-name substring.
DENSE_BF16_PEAK = {"H200": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12}
_VISION_PREFIXES = ("vision_tower", "visual", "multi_modal_projector", "model.visual", "model.vision_tower",
                    "model.multi_modal_projector")


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a checkpoint."""

    layer_params: int  # the language model's parameters per token (all decoder layers, no embeddings)
    head_params: int  # the output head (vocabulary x hidden)
    num_layers: int
    query_width: int  # heads x head dim
    kv_bytes_per_token: int  # K and V of every layer, in the served dtype
    vision_params: int  # the tower and projector; 0 when the checkpoint has no weights to count
    dtype_bytes: int
    # A mixture of experts (else zeros): layer_params counts each MoE layer's top_k experts and router.
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0  # one expert's gate, up and down

    @property
    def decode_weight_bytes(self) -> int:
        """What one decode step of one sequence reads of the weights."""
        return (self.layer_params + self.head_params) * self.dtype_bytes

    def decode_step_bytes(self, rows: int) -> float:
        """What one decode step of `rows` sequences reads of the weights: a mixture of experts reads the
        experts its rows hit (expected_experts of them per MoE layer) rather than top_k."""
        extra = expected_experts(self.num_experts, self.top_k, rows) - self.top_k if self.moe_layers else 0
        return self.decode_weight_bytes + self.moe_layers * extra * self.expert_params * self.dtype_bytes


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens hit when each picks top_k of num_experts uniformly: the experts a
    decode step of `rows` sequences reads per MoE layer (top_k at one row, all of them for many)."""
    if rows <= 1:
        return float(min(top_k, rows * top_k))
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def model_shape(model_dir: str | Path, dtype: str) -> ModelShape:
    """The shape figures of the checkpoint in model_dir served in `dtype`."""
    config = load_config(model_dir)
    text = TextModelConfig.from_hf(config.get("text_config", config))
    h, q, kv = text.hidden_size, text.num_heads * text.head_dim, text.num_kv_heads * text.head_dim
    attention = h * q + 2 * h * kv + q * h
    expert = 3 * h * text.moe_intermediate_size
    moe_layers = sum(text.layer_is_moe(i) for i in range(text.num_layers))
    active_moe = h * text.num_experts + text.num_experts_per_tok * expert  # router + top_k experts
    dense_mlp = 3 * h * text.intermediate_size
    layers = text.num_layers
    layer_params = layers * attention + (layers - moe_layers) * dense_mlp + moe_layers * active_moe
    size = parse_dtype(dtype).itemsize
    return ModelShape(layer_params=layer_params, head_params=text.vocab_size * h,
                      num_layers=text.num_layers, query_width=q,
                      kv_bytes_per_token=2 * text.num_layers * kv * size,
                      vision_params=_vision_params(model_dir), dtype_bytes=size, moe_layers=moe_layers,
                      num_experts=text.num_experts if moe_layers else 0,
                      top_k=text.num_experts_per_tok if moe_layers else 0,
                      expert_params=expert if moe_layers else 0)


def _vision_params(model_dir: str | Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(_VISION_PREFIXES):
                    total += math.prod(f.get_slice(name).get_shape())
    return total


@dataclass(frozen=True)
class Workload:
    """The work a serving run was asked to do."""

    requests: int
    mean_prompt_tokens: float  # text and image tokens
    output_len: int
    concurrency: int
    distinct_images: int
    patches_per_image: int  # the tower's sequence per image


def peak_flops(device: str, dtype: str) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from): the data sheet's dense bf16 peak for a known GPU, else a
    measured 4096^2 matmul in dtype."""
    dev = torch.device(device)
    if dev.type == "cuda" and dtype == "bfloat16":
        name = torch.cuda.get_device_name(dev)
        for key, flops in DENSE_BF16_PEAK.items():
            if key in name:
                return flops, f"data sheet ({name})"
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(parse_dtype(dtype))
    a @ a
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        a @ a
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0), f"measured {n}x{n} matmul"


def roofline(shape: ModelShape, work: Workload, peak: float, bandwidth: float) -> dict:
    """The roofline's parts and total, in FLOPs, bytes and seconds."""
    n = work.mean_prompt_tokens
    prefill = work.requests * (2 * n * shape.layer_params + 2 * shape.num_layers * shape.query_width * n * n
                               + 2 * shape.head_params)
    vision = work.distinct_images * 2 * shape.vision_params * work.patches_per_image
    rounds = math.ceil(work.requests / max(work.concurrency, 1))
    steps = rounds * max(work.output_len - 1, 0)
    # Each step of a round reads every running sequence's context: n, n + 1, ... tokens.
    kv_tokens = work.requests * sum(n + j for j in range(1, work.output_len))
    step_bytes = shape.decode_step_bytes(min(max(work.concurrency, 1), work.requests))
    decode = steps * step_bytes + kv_tokens * shape.kv_bytes_per_token
    compute_s, memory_s = (prefill + vision) / peak, decode / bandwidth
    return {"prefill_flops": prefill, "vision_flops": vision, "decode_bytes": decode, "decode_steps": steps,
            "peak_flops": peak, "bandwidth_bytes_s": bandwidth, "compute_s": compute_s, "memory_s": memory_s,
            "roofline_s": compute_s + memory_s}


def measure_roofline(model_dir: str | Path, device: str, dtype: str, work: Workload,
                     wall_s: float) -> dict:
    """The workload's roofline on this device, and the measured wall time over it."""
    shape = model_shape(model_dir, dtype)
    peak, source = peak_flops(device, dtype)
    bandwidth = copy_bandwidth(device, 1 << 30 if torch.device(device).type == "cuda" else 1 << 26)
    result = roofline(shape, work, peak, bandwidth)
    result.update(peak_source=source, wall_s=wall_s, wall_over_roofline=wall_s / result["roofline_s"],
                  workload=asdict(work), shape=asdict(shape))
    return result


def patches_per_image(model_dir: str | Path, image_size: int) -> int:
    """The vision tower's sequence length for one square image of image_size pixels."""
    from bench.workload import lays_out_by_grid
    from common.families.llava.layout import load_image_token_layout
    from common.families.registry import layout_family

    config = load_config(model_dir)
    if lays_out_by_grid(config):
        layout = layout_family(config).image_layout(model_dir, config)
        return math.prod(layout.grid(image_size, image_size, layout.pixel_range()))
    layout = load_image_token_layout(model_dir)
    return layout.num_patches + int(layout.has_cls)


def distinct(images: Sequence[bytes]) -> int:
    """How many different images there are."""
    return len(set(images))
