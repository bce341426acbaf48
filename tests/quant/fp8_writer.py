"""Writing FP8 checkpoints of a test model as the published formats lay them out, and their twins.

compressed-tensors (what llm-compressor's `save_pretrained` writes for FP8 schemes): each quantized
Linear's `weight` in float8_e4m3fn and `weight_scale` ([N, 1] per channel, [1] per tensor, [N/bn, K/bk]
per block), `input_scale` [1] for static activations, and config.json's `quantization_config` with
`quant_method: compressed-tensors`, `format: float-quantized`, `config_groups` and `ignore`.
HF fine-grained FP8 (transformers' FineGrainedFP8 / Qwen's -FP8 releases): `weight` in float8_e4m3fn and
`weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (a multiplier), `quant_method: fp8`, `weight_block_size`.

The twin is the same checkpoint with every FP8 weight replaced by its dequantized value in the original
dtype: what an exact FP8 implementation must compute.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from decoder_svc.model.quant.fp8 import FP8_DTYPE, FP8_MAX, ScaleBlock, dequantize

_PROJECTION = re.compile(  # the language model's decoder-layer projections (not the vision tower's)
    r"(language_model\.(model\.)?|^model\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _quantize(w: torch.Tensor, block: ScaleBlock) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = block.grid(n, k)
    padded = torch.zeros(rows * block.rows, cols * block.cols)
    padded[:n, :k] = w.float()
    tiles = padded.view(rows, block.rows, cols, block.cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block.rows, 0)[:n].repeat_interleave(block.cols, 1)[:, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def write_fp8_checkpoint(src: Path, out: Path, twin: Path, fmt: str, strategy: str = "channel",
                         block: tuple[int, int] = (32, 32), quantize_lm_head: bool = False,
                         static_input: bool = False) -> None:
    """Write `src` as an FP8 checkpoint in `out` (fmt: "compressed-tensors" with strategy channel, tensor
    or block; or "fine-grained" with `block`) and its dequantized twin in `twin`."""
    for d in (out, twin):
        shutil.copytree(src, d, dirs_exist_ok=True)
        (d / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    quantized, twin_tensors = {}, {}
    for name, w in tensors.items():
        is_head = name.endswith("lm_head.weight") and quantize_lm_head
        if not (_PROJECTION.search(name) or is_head):
            quantized[name] = twin_tensors[name] = w
            continue
        n, k = w.shape
        if fmt == "fine-grained" or strategy == "block":
            sb = ScaleBlock(*block)
        elif strategy == "tensor":
            sb = ScaleBlock(n, k)
        else:
            sb = ScaleBlock(1, k)
        q, scale = _quantize(w, sb)
        module = name[: -len(".weight")]
        quantized[name] = q
        if fmt == "fine-grained":
            quantized[f"{module}.weight_scale_inv"] = scale
        else:
            quantized[f"{module}.weight_scale"] = scale.reshape(1) if strategy == "tensor" else scale
            if static_input:
                quantized[f"{module}.input_scale"] = torch.tensor([0.05])
        twin_tensors[name] = dequantize(q, scale, sb, w.dtype)
    save_file(quantized, str(out / "model.safetensors"))
    save_file(twin_tensors, str(twin / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, strategy, block, static_input)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _quantization_config(fmt: str, strategy: str, block: tuple[int, int], static_input: bool) -> dict:
    if fmt == "fine-grained":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ["vision_tower"]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": list(block) if strategy == "block" else None, "observer": "minmax"}
    acts = ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
            if static_input else
            {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"})
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "output_activations": None}}}
