"""Which FP8 checkpoints we load, read from config.json's `quantization_config`.

Supported (weights in float8_e4m3fn; activations stay in the model dtype, so a checkpoint's static
input scales are not needed and are ignored):

- **compressed-tensors** (`quant_method: compressed-tensors`, as llm-compressor writes it), format
  `float-quantized` or `naive-quantized`, 8-bit float weights with strategy `channel`, `tensor` or
  `block`; tensors `<module>.weight` and `<module>.weight_scale` (plus `input_scale` when static);
- **HF fine-grained FP8** (`quant_method: fp8`, e.g. Qwen's `-FP8` releases), `weight_block_size`
  blocks; tensors `<module>.weight` and `<module>.weight_scale_inv` (a multiplier despite its name).

Everything else (AWQ, GPTQ, bitsandbytes, int8 or 4-bit compressed-tensors, FP8 KV-cache schemes) is
refused at start-up with a CheckpointError naming what was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.checkpoint import CheckpointError
from decoder_svc.model.quant.fp8 import ScaleBlock, per_channel_block

_CT_FORMATS = {"float-quantized", "naive-quantized"}


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 checkpoint layout: how its scale tensors are named and blocked."""

    name: str
    scale_suffix: str  # the scale tensor's name after "<module>."
    block: tuple[int, int] | None  # declared weight block (rows, cols); None: per channel or per tensor

    def scale_block(self, scale: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ScaleBlock]:
        """A module's stored scale as (fp32 [rows, cols] scales, their ScaleBlock) for an [n, k] weight.
        A per-tensor scale becomes n equal per-channel scales (the same numbers)."""
        scale = scale.float()
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(n, 1).contiguous(), per_channel_block(k)
        if scale.numel() == n and self.block is None:
            return scale.reshape(n, 1), per_channel_block(k)
        if self.block is not None:
            block = ScaleBlock(*self.block)
            if tuple(scale.shape) == block.grid(n, k):
                return scale, block
        raise CheckpointError(f"{self.name}: a scale of shape {tuple(scale.shape)} does not fit an "
                              f"[{n}, {k}] weight with block {self.block}")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported; FP8 checkpoints "
                              f"({sorted(_CT_FORMATS)}) are")
    if qc.get("kv_cache_scheme"):
        raise CheckpointError("compressed-tensors kv_cache_scheme (an FP8 KV cache) is not supported")
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise CheckpointError(f"compressed-tensors group {name}: weights {w.get('type')} "
                                  f"{w.get('num_bits')}-bit are not supported; only 8-bit float (FP8)")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise CheckpointError(f"compressed-tensors group {name}: weight strategy {strategy!r} is not "
                                  "supported (channel, tensor or block)")
        act = group.get("input_activations") or {}
        if act and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise CheckpointError(f"compressed-tensors group {name}: input activations "
                                  f"{act.get('type')} {act.get('num_bits')}-bit are not supported")
        if strategy == "block":
            structure = w.get("block_structure")
            if not structure or len(structure) != 2:
                raise CheckpointError(f"compressed-tensors group {name}: block strategy without a "
                                      "[rows, cols] block_structure")
            blocks.add(tuple(int(b) for b in structure))
    if not qc.get("config_groups"):
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    if len(blocks) > 1:
        raise CheckpointError(f"compressed-tensors groups with different blocks {sorted(blocks)}")
    return Fp8Format("compressed-tensors", "weight_scale", blocks.pop() if blocks else None)


def _fine_grained(qc: dict[str, Any]) -> Fp8Format:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"FP8 format {qc.get('fmt')!r} is not supported; only e4m3")
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise CheckpointError(f"weight_block_size {block} must be [rows, cols]")
    return Fp8Format("fp8 (fine-grained)", "weight_scale_inv",
                     tuple(int(b) for b in block) if block else None)


def checkpoint_fp8_format(config: dict[str, Any]) -> Fp8Format | None:
    """The FP8 layout a checkpoint's config.json declares, None for an unquantized checkpoint; raises
    CheckpointError for any other quantization."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained(qc)
    raise CheckpointError(f"quantization {method!r} is not supported; FP8 checkpoints in the "
                          "compressed-tensors or HF fine-grained format are, or --quantization fp8 on a "
                          "bf16/fp16 checkpoint")
