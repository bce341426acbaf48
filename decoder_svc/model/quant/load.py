"""Turning a checkpoint's language-model tensors into FP8 layers' state: FP8 checkpoints as published,
or a bf16/fp16 checkpoint quantized per output channel at load (`--quantization fp8`).

Works on our parameter names before q/k/v and gate/up are fused (loader.pack_fused_weights fuses the
FP8 weights and their scales like any other tensor, once the shards' scale blocks agree).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.checkpoint import CheckpointError
from decoder_svc.model.quant.formats import Fp8Format
from decoder_svc.model.quant.fp8 import (
    FP8_DTYPE,
    ScaleBlock,
    dequantize,
    per_channel_block,
    quantize_per_channel,
    rows_to_channels,
)
from decoder_svc.model.quant.linear import QUANTIZED_PROJECTIONS

SCALE = "weight_scale"  # our scale parameter's name (Fp8Linear.weight_scale)
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns under tensor parallelism


def read_fp8_checkpoint(state: dict[str, torch.Tensor], fmt: Fp8Format, dtype: torch.dtype,
                        packed: dict[str, tuple[str, int]],
                        shard: Callable[[str, torch.Tensor, tuple[int, int]], tuple[torch.Tensor, ScaleBlock]]
                        | None = None) -> dict[str, ScaleBlock]:
    """Rewrite `state` (in place) from the checkpoint's FP8 layout to ours: per module `weight` (FP8) and
    `weight_scale` (fp32, as Fp8Format.scale_block canonicalises it). Modules we keep in `dtype` (e.g. an
    FP8 lm_head) are dequantized. `packed` maps checkpoint projections to our fused ones (q_proj ->
    qkv_proj). `shard(module, whole scale, local weight shape)`: a tensor-parallel rank's canonical scales
    for its weight slice (model/parallel.py shard_fp8_scale). Returns {checkpoint module name: its scale
    block} for the FP8 modules kept."""
    fp8_modules = [n[: -len(".weight")] for n, t in state.items()
                   if n.endswith(".weight") and t.dtype == FP8_DTYPE]
    scale_names = {f"{m}.{suffix}" for m in fp8_modules for suffix in (fmt.scale_suffix, "input_scale")}
    leftovers = [n for n in state if n.endswith((f".{fmt.scale_suffix}", ".input_scale"))
                 and n not in scale_names]
    if leftovers:
        raise CheckpointError(f"{fmt.name} checkpoint: scales without an FP8 weight: {leftovers[:3]}")
    blocks: dict[str, ScaleBlock] = {}
    for module in fp8_modules:
        scale = state.pop(f"{module}.{fmt.scale_suffix}", None)
        if scale is None:
            raise CheckpointError(f"{fmt.name} checkpoint: {module}.weight is FP8 but has no "
                                  f"{fmt.scale_suffix}")
        state.pop(f"{module}.input_scale", None)  # activations stay in the model dtype
        q = state[f"{module}.weight"]
        scale, block = shard(module, scale, tuple(q.shape)) if shard else fmt.scale_block(scale, *q.shape)
        leaf = module.rsplit(".", 1)[-1]
        if module.startswith("layers.") and packed.get(leaf, (leaf,))[0] in QUANTIZED_PROJECTIONS:
            state[f"{module}.{SCALE}"] = scale
            blocks[module] = block
        else:
            state[f"{module}.weight"] = dequantize(q, scale, block, dtype)
    return blocks


def align_shard_blocks(state: dict[str, torch.Tensor], blocks: dict[str, ScaleBlock],
                       packed: dict[str, tuple[str, int]]) -> dict[str, ScaleBlock]:
    """Make the shards that fuse into one matrix share a scale layout, and return the fused modules'
    blocks. Shards whose rows do not fill whole scale blocks (or whose layouts differ) get one scale row
    per weight row, which keeps every scale exact."""
    groups: dict[str, list[str]] = {}
    for module in blocks:
        parent, _, leaf = module.rpartition(".")
        target = f"{parent}.{packed[leaf][0]}" if leaf in packed else module
        groups.setdefault(target, []).append(module)
    fused: dict[str, ScaleBlock] = {}
    for target, modules in groups.items():
        shard_blocks = {blocks[m] for m in modules}
        aligned = len(shard_blocks) == 1 and all(
            state[f"{m}.weight"].shape[0] % blocks[m].rows == 0 for m in modules)
        if len(modules) == 1 or aligned:
            fused[target] = blocks[modules[0]]
            continue
        cols = {b.cols for b in shard_blocks}
        if len(cols) != 1:
            raise CheckpointError(f"{target}: shards with different column blocks {sorted(cols)}")
        for m in modules:
            n = state[f"{m}.weight"].shape[0]
            state[f"{m}.{SCALE}"] = rows_to_channels(state[f"{m}.{SCALE}"], blocks[m], n)
        fused[target] = ScaleBlock(1, cols.pop())
    return fused


def check_all_or_none(state: dict[str, torch.Tensor], fused: dict[str, ScaleBlock],
                      packed: dict[str, tuple[str, int]]) -> None:
    """Every shard of a fused FP8 module must be FP8 (an fp16 k_proj beside FP8 q/v cannot fuse)."""
    for name, t in state.items():
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        if not name.endswith(".weight") or leaf not in packed or t.dtype == FP8_DTYPE:
            continue
        if f"{parent}.{packed[leaf][0]}" in fused:
            raise CheckpointError(f"{name} is not FP8 but the other shards of its fused module are")


def quantize_projections(state: dict[str, torch.Tensor], device: torch.device | str,
                         reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> dict[str, ScaleBlock]:
    """`--quantization fp8`: quantize every decoder-layer projection of a fused state (in place) per
    output channel, on `device`; returns {module: block}. reduce_amax (tensor parallelism): the largest
    magnitude of each output row over every rank's columns, for the row-parallel projections (o, down),
    so that each rank's slice gets the scales the whole weight has and TP=N quantizes as TP=1 does."""
    blocks = {}
    for name in [n for n in state if n.endswith(".weight")]:
        module = name[: -len(".weight")]
        leaf = module.rsplit(".", 1)[-1]
        if not (module.startswith("layers.") and leaf in QUANTIZED_PROJECTIONS):
            continue
        across = reduce_amax if leaf in ROW_PARALLEL else None
        q, scale = quantize_per_channel(state[name].to(device), across)
        state[name], state[f"{module}.{SCALE}"] = q, scale
        blocks[module] = per_channel_block(q.shape[1])
    return blocks
