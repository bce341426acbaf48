"""Adapters a checkpoint carries inside itself (a family's `checkpoint_adapters`), served through the same
slots as --lora-modules adapters.

Phi-4-multimodal (microsoft/Phi-4-multimodal-instruct) stores its vision and speech LoRA in its own weight
files, as PEFT's wrapped layers name them: `<module>.base_layer.weight` (the base weight, which the loader
reads as the module's own), `<module>.lora_A.<name>.weight` [r, in] and `<module>.lora_B.<name>.weight`
[out, r]; config.json's `<name>_lora` dict gives `r`, `lora_alpha`, `dp` (dropout, unused here) and
`layer` (PEFT's target_modules regex over the module paths). The adapter named `<name>` is read from
those; a checkpoint that has the adapter as a PEFT directory `<name>-lora/` beside its weights (as the
transformers-format release does) is read by adapter.load_adapter instead. With `--load-format dummy`
the adapter is drawn at random at the config's rank for every module its regex targets.
"""

from __future__ import annotations

import math
import re
import zlib
from pathlib import Path

import torch

from common.checkpoint import load_config, safetensors_files
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.lora.adapter import (
    LORA_TARGETS,
    KeyRenamer,
    LoRAAdapter,
    LoRAError,
    check_alpha,
    check_finite,
    check_pair,
    load_adapter,
    module_dims,
)

_LEAVES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # {(layer, "block.module"): (A, B)}


def builtin_adapter_names(model_dir: str | Path) -> list[str]:
    """The adapters the checkpoint's family serves from the checkpoint itself (its family's
    checkpoint_adapters), in that order; [] for a family that declares none or a config no family claims."""
    from common.families.registry import find_family

    family = find_family(load_config(model_dir))
    return list(family.checkpoint_adapters) if family is not None else []


def _lora_config(config: dict, name: str) -> dict:
    spec = config.get(f"{name}_lora")
    if not isinstance(spec, dict) or not isinstance(spec.get("r"), int) or isinstance(spec["r"], bool) \
            or spec["r"] < 1:
        raise LoRAError(f"built-in LoRA adapter {name!r}: config.json has no `{name}_lora` with a positive "
                        f"integer `r` (and no {name}-lora/ adapter directory)")
    return spec


def _targets(spec: dict, module: str) -> bool:
    layer = spec.get("layer")
    return not isinstance(layer, str) or re.search(layer, module) is not None


def load_builtin_adapter(model_dir: str | Path, name: str, cfg: TextModelConfig, dummy: bool = False,
                         dtype: torch.dtype | None = None, *, rename_key: KeyRenamer) -> LoRAAdapter:
    """Adapter `name` of the checkpoint in model_dir, checked against the language model's config `cfg`
    (and its weights against the serving dtype); `dummy`: drawn at random from config.json alone;
    `rename_key`: load_adapter's, for an adapter stored in PEFT's layout beside the checkpoint. LoRAError
    says what is wrong."""
    model_dir = Path(model_dir)
    peft_dir = model_dir / f"{name}-lora"
    if not dummy and peft_dir.is_dir():
        return load_adapter(name, peft_dir, cfg, rename_key, dtype)
    who = f"built-in LoRA adapter {name!r}"
    spec = _lora_config(load_config(model_dir), name)
    r = spec["r"]
    alpha = check_alpha(who, f"config.json `{name}_lora`", spec["lora_alpha"]) if "lora_alpha" in spec else r
    scale = alpha / r
    adapter = LoRAAdapter(name, model_dir)
    pairs = _dummy_pairs(spec, cfg) if dummy else _checkpoint_pairs(model_dir, name)
    for (layer, leaf), (a, b) in sorted(pairs.items()):
        module = f"layers.{layer}.{leaf}"
        if layer >= cfg.num_layers or leaf.split(".")[1] not in LORA_TARGETS:
            raise LoRAError(f"built-in LoRA adapter {name!r}: unknown target module {module!r}")
        check_pair(f"built-in LoRA adapter {name!r}", module, leaf.split(".")[1], a, b, r, cfg)
        if not _targets(spec, "model." + module):
            raise LoRAError(f"built-in LoRA adapter {name!r}: {module!r} has weights but `{name}_lora.layer` "
                            f"({spec.get('layer')!r}) does not target it")
        a, b = a.float(), b.float() * scale
        check_finite(who, f"{model_dir}: {module}.lora_A.{name}", a, dtype)
        check_finite(who, f"{model_dir}: {module}.lora_B.{name} times its scale {scale:.4g}", b, dtype)
        adapter.weights[(layer, leaf.split(".")[1])] = (a.contiguous(), b.contiguous())
    if not adapter.weights:
        raise LoRAError(f"built-in LoRA adapter {name!r}: {model_dir} holds no lora_A.{name} / "
                        f"lora_B.{name} weights")
    return adapter


_KEY = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(?P<layer>\d+)\.(?P<leaf>\w+\.\w+)"
                  r"\.lora_(?P<ab>[AB])\.(?P<name>[\w-]+)\.weight$")


def _checkpoint_pairs(model_dir: Path, name: str) -> Pairs:
    """{(layer, "block.module"): (A, B)} of the adapter's tensors in the checkpoint's weight files."""
    from safetensors import safe_open

    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
                m = _KEY.match(key)
                if m is not None and m["name"] == name:
                    found.setdefault((int(m["layer"]), m["leaf"]), {})[m["ab"]] = f.get_tensor(key)
    for (layer, leaf), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"built-in LoRA adapter {name!r}: layers.{layer}.{leaf} has no lora_"
                            f"{'A' if 'B' in ab else 'B'}")
    return {k: (ab["A"], ab["B"]) for k, ab in found.items()}


def _dummy_pairs(spec: dict, cfg: TextModelConfig) -> Pairs:
    """Random A and B (small B) at the config's rank for every module its `layer` regex targets."""
    r, pairs = spec["r"], {}
    for layer in range(cfg.num_layers):
        for leaf in _LEAVES:
            if not _targets(spec, f"model.layers.{layer}.{leaf}"):
                continue
            out, inp = module_dims(leaf.split(".")[1], cfg)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{leaf}".encode()))
            a = torch.randn(r, inp, generator=gen) / math.sqrt(inp)
            b = torch.randn(out, r, generator=gen) * (0.01 / math.sqrt(r))
            pairs[(layer, leaf)] = (a, b)
    return pairs
