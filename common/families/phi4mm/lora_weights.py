"""Phi-4-multimodal's LoRA adapters as its checkpoint stores them, written by the maker and merged by the
oracle.

microsoft/Phi-4-multimodal-instruct keeps its vision and speech adapters in its own weight files, under
PEFT's wrapped-layer names: `model.layers.N.<block>.<module>.base_layer.weight` (the base weight),
`....lora_A.<adapter>.weight` [r, in] and `....lora_B.<adapter>.weight` [out, r], for the modules
config.json's `<adapter>_lora.layer` regex targets (qkv_proj, o_proj, gate_up_proj, down_proj of every
layer), with `r`, `lora_alpha` and `dp` beside it. HF transformers' Phi4MultimodalForCausalLM has no
LoRA modules and names the base weight `....<module>.weight`: merged_language_state gives it those
tensors, with an adapter merged in (W + lora_alpha / r * B @ A) or none.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

# The real checkpoint's config.json values (r, lora_alpha, dp, the targeted modules' regex).
TARGETS_REGEX = r"layers.*((self_attn\.(qkv|o)_proj)|(mlp\.(gate_up|down)_proj))"
REAL_LORA = {"vision": {"r": 256, "lora_alpha": 512, "dp": 0.0, "layer": TARGETS_REGEX},
             "speech": {"r": 320, "lora_alpha": 640, "dp": 0.01, "layer": TARGETS_REGEX}}
TINY_LORA = {"vision": {"r": 8, "lora_alpha": 16, "dp": 0.0, "layer": TARGETS_REGEX},
             "speech": {"r": 4, "lora_alpha": 8, "dp": 0.01, "layer": TARGETS_REGEX}}
DELTA_STD = 0.5  # the typical size of one output of an adapter's product, against ~1.4 of the base's


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


@torch.no_grad()
def add_lora_weights(model_dir: str | Path, adapters: dict[str, dict], seed: int) -> None:
    """Rewrite a saved Phi4MultimodalForCausalLM checkpoint in the real one's naming: each targeted module's
    weight under `.base_layer.`, random adapters beside it (A ~ N(0, 1/in), B non-zero, scaled so that the
    product moves each output by about DELTA_STD), and config.json's `<name>_lora` dicts."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    gen = torch.Generator().manual_seed(seed + 7919)
    renamed: dict[str, str] = {}
    for path in _weight_files(model_dir):
        state = load_file(str(path))
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            module = key.removesuffix(".weight")
            if not (key.startswith("model.layers.") and key.endswith(".weight")
                    and re.search(TARGETS_REGEX, module)):
                out[key] = tensor
                continue
            out[f"{module}.base_layer.weight"] = tensor
            renamed[key] = path.name
            n, k = tensor.shape
            for name, spec in adapters.items():
                r = spec["r"]
                b_std = DELTA_STD / (spec["lora_alpha"] / r * math.sqrt(r))
                out[f"{module}.lora_A.{name}.weight"] = (torch.randn(r, k, generator=gen) / math.sqrt(k)
                                                          ).to(tensor.dtype)
                out[f"{module}.lora_B.{name}.weight"] = (torch.randn(n, r, generator=gen) * b_std
                                                          ).to(tensor.dtype)
        save_file(out, str(path), metadata={"format": "pt"})
        _update_index(model_dir, path.name, out)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update({f"{name}_lora": dict(spec) for name, spec in adapters.items()})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _update_index(model_dir: Path, file_name: str, state: dict[str, torch.Tensor]) -> None:
    """A sharded checkpoint's index names every tensor of a rewritten shard."""
    index_path = model_dir / "model.safetensors.index.json"
    if not index_path.exists():
        return
    index = json.loads(index_path.read_text())
    weight_map = {k: v for k, v in index["weight_map"].items() if v != file_name}
    weight_map.update({k: file_name for k in state})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def merged_language_state(model_dir: str | Path, adapter: str | None) -> dict[str, torch.Tensor]:
    """{HF's name: fp32 weight} of every LoRA-wrapped module (`.base_layer.` dropped), with `adapter`'s
    product merged in as W + lora_alpha / r * B @ A (None: the base weights)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        tensors.update(load_file(str(path)))
    spec = json.loads((model_dir / "config.json").read_text()).get(f"{adapter}_lora") if adapter else None
    if adapter and not spec:
        raise ValueError(f"{model_dir} has no {adapter}_lora in its config.json")
    out = {}
    for key, w in tensors.items():
        if not key.endswith(".base_layer.weight"):
            continue
        module = key.removesuffix(".base_layer.weight")
        merged = w.float()
        if spec:
            a, b = tensors[f"{module}.lora_A.{adapter}.weight"], tensors[f"{module}.lora_B.{adapter}.weight"]
            merged = merged + spec["lora_alpha"] / spec["r"] * (b.float() @ a.float())
        out[f"{module}.weight"] = merged
    return out
