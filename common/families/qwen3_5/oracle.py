"""The Qwen3.5 oracle: Hugging Face's Qwen3_5ForConditionalGeneration on the same checkpoint (fp32, CPU).

Inputs are built as for Qwen3-VL (common/families/qwen3_vl/oracle.py, whose oracle this is with another
HF class and no DeepStack levels: the checkpoint's Qwen2-VL image processor and tokenizer, HF's processor
class needing torchvision). On a CPU without the `fla` and `causal-conv1d` kernels HF runs its torch
fallbacks of the Gated DeltaNet layers: the reference our layer (decoder_svc/model/gated_deltanet.py) is
checked against.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch

from common.families.qwen3_vl.oracle import IMAGE_PAD, Qwen3Oracle

__all__ = ["IMAGE_PAD", "Qwen3_5Oracle"]


class Qwen3_5Oracle(Qwen3Oracle):
    """greedy `generate` and `get_image_features` of HF's model (fp32, CPU)."""

    hf_class = "Qwen3_5ForConditionalGeneration"

    def __init__(self, model_dir) -> None:
        super().__init__(model_dir)
        torch_fallbacks(self.model)

    def generate(self, prompt: str, images: list, n: int) -> list[int]:
        with torch_paths(sys.modules[type(self.model).__module__]):
            return super().generate(prompt, images, n)

    def image_features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """get_image_features of one batch as [rows_i, hidden] per image (the merged features: Qwen3.5 has
        no DeepStack levels)."""
        with torch.no_grad(), torch_paths(sys.modules[type(self.model).__module__]):
            out = self.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grids)
        merged = out.pooler_output
        merged = merged if isinstance(merged, torch.Tensor) else torch.cat(list(merged))
        return list(merged.split([int(g.prod()) // self.merge**2 for g in grids]))


# Per-layer attributes older transformers bind to fla's (or causal-conv1d's) kernels when those import,
# whatever device the model is on, and the torch fallbacks of the modeling module that replace them.
_FALLBACKS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
              "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
              "causal_conv1d_update": "torch_causal_conv1d_update"}


def torch_fallbacks(model: torch.nn.Module) -> int:
    """Point a CPU model's Gated DeltaNet layers at HF's torch fallbacks (the oracle). Newer transformers
    pick the fallback per call by the inputs' device and bind nothing per layer: then this changes nothing.
    Older ones bind fla's Triton kernels at construction when fla imports (a GPU machine), which fail on
    CPU tensors, and build the output norm as fla's fused module. Returns the number of attributes
    replaced."""
    if next(model.parameters()).device.type != "cpu":
        return 0
    modeling = sys.modules[type(model).__module__]
    replaced = 0
    for module in model.modules():
        for name, fallback in _FALLBACKS.items():
            reference = _torch_function(modeling, fallback)
            if reference is not None and getattr(module, name, reference) is not reference:
                setattr(module, name, reference)
                replaced += 1
        if getattr(module, "causal_conv1d_fn", None) is not None:
            module.causal_conv1d_fn = None  # None: the layer's own conv1d + silu
            replaced += 1
        norm = getattr(module, "norm", None)
        if type(norm).__name__ == "FusedRMSNormGated":
            module.norm = _torch_gated_norm(modeling, norm, next(model.parameters()).dtype)
            replaced += 1
    return replaced


@contextlib.contextmanager
def torch_paths(modeling) -> Iterator[None]:
    """The modeling module's fallbacks as their own torch functions while the block runs. Some transformers
    versions wrap each fallback in a dispatcher that picks fla's kernel whenever fla imports, whatever the
    inputs' device; a layer calling the module-level name then reaches a Triton kernel with CPU tensors."""
    saved = {}
    for fallback in _FALLBACKS.values():
        wrapper = getattr(modeling, fallback, None)
        function = _torch_function(modeling, fallback)
        if wrapper is not function:
            saved[fallback] = wrapper
            setattr(modeling, fallback, function)
    try:
        yield
    finally:
        for fallback, wrapper in saved.items():
            setattr(modeling, fallback, wrapper)


def _torch_function(modeling, name: str):
    """The torch function behind the modeling module's `name`, under any kernel dispatch decorators."""
    function = getattr(modeling, name, None)
    return None if function is None else inspect.unwrap(function)


def _torch_gated_norm(modeling, fused: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The modeling module's gated RMS norm (norm, then times silu(gate)) with fla's module's weight and eps
    (fla's module was made on the GPU in the checkpoint's dtype: the copy takes the model's)."""
    (cls,) = [c for name, c in vars(modeling).items()
              if name.endswith("RMSNormGated") and isinstance(c, type) and c is not type(fused)]
    norm = cls(fused.weight.shape[-1], eps=fused.eps)
    norm.weight = torch.nn.Parameter(fused.weight.detach().to("cpu", dtype).clone())
    return norm
