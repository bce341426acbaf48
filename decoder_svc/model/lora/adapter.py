"""Read a LoRA adapter in PEFT's directory layout, for the language model's projections.

The layout (what PEFT's `save_pretrained` writes): `adapter_config.json` with `r`, `lora_alpha`,
`target_modules` (a list of module names, or a regex string) and optionally `rank_pattern`,
`alpha_pattern`, `use_rslora`; `adapter_model.safetensors` with `<path>.lora_A.weight` [r, in] and
`<path>.lora_B.weight` [out, r] per adapted module, `<path>` the module's path in the base model under
`base_model.model.`. The path is renamed as the base checkpoint's keys are (the loader passes its
rename_language_model_key in), so an adapter for any layout the loader reads (LLaVA's, Qwen-VL's, Gemma 3's)
maps onto our layers.

Served targets: the attention's q/k/v/o and the MLP's gate/up/down projections, or the fused qkv_proj and
gate_up_proj as Phi-4 names them. Each module's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is
folded into its B here. Anything else (another module, DoRA, LoRA biases, fan-in-fan-out weights, modules
to save, a tensor whose rank or shape does not match) is refused with a LoRAError at start-up.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.checkpoint import CheckpointError
from decoder_svc.model.config import TextModelConfig

# Checkpoint module name -> (our module, its part: index among the fused parts, None for the whole module).
LORA_TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None), "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None),
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# A base checkpoint key -> our parameter name, or None for a key that is not language-model weight.
KeyRenamer = Callable[[str], str | None]
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_LAYER = re.compile(r"^layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<leaf>\w+)\.weight$")


class LoRAError(CheckpointError):
    """An adapter this server cannot serve: refused at start-up with this message."""


@dataclass
class LoRAAdapter:
    """One adapter: per (layer, checkpoint module name), A [r, in] and B [out, r] with the scaling folded
    into B, in fp32 on the CPU."""

    name: str
    path: Path
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        """The largest rank of its modules."""
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)


def module_dims(leaf: str, cfg: TextModelConfig) -> tuple[int, int]:
    """(output rows, input columns) of a served target module of the whole (unsharded) model."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i), "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)
            }[leaf]


def check_pair(who: str, module: str, leaf: str, a: torch.Tensor, b: torch.Tensor, r: int,
               cfg: TextModelConfig) -> None:
    """LoRAError (its message starting with `who`) unless lora_A [r, in] and lora_B [out, r] fit the
    model's `leaf` projection at rank r."""
    out, inp = module_dims(leaf, cfg)
    if a.shape[0] != r or b.dim() != 2 or b.shape[1] != r:
        raise LoRAError(f"{who}: rank mismatch at {module!r}: lora_A {list(a.shape)}, "
                        f"lora_B {list(b.shape)}, but r = {r}")
    if a.shape[1] != inp or b.shape[0] != out:
        raise LoRAError(f"{who}: {module!r} is [{b.shape[0]} x {a.shape[1]}], the "
                        f"model's {leaf} is [{out} x {inp}]: an adapter for another model?")


def _read_config(path: Path, name: str) -> dict:
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory (PEFT's layout: {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / needed).is_file():
            raise LoRAError(f"LoRA adapter {name!r}: {path} has no {needed}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {path / CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs a positive integer `r`")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan-in-fan-out weights", "modules_to_save": "modules "
               "to save", "use_qalora": "QA-LoRA"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} ({key}) is not served")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: LoRA biases (bias={config['bias']!r}) are not served")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown:
            raise LoRAError(f"LoRA adapter {name!r}: unknown target module(s) {unknown}; served: "
                            f"{sorted(LORA_TARGETS)}")
    return config


def _pattern_value(pattern: dict, path: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the module's path."""
    for key, value in (pattern or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", path):
            return value
    return default


def load_adapter(name: str, path: str | Path, cfg: TextModelConfig, rename_key: KeyRenamer) -> LoRAAdapter:
    """Read and check the adapter at `path` against the language model's (whole) config `cfg`; its module
    paths are named as the base checkpoint's keys, which `rename_key` maps to ours
    (loader.rename_language_model_key: passed in, as the loader imports this module)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = _read_config(path, name)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which adapter
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {path / WEIGHTS_FILE}: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight "
                            "(embedding adapters and saved modules are not served)")
        pairs.setdefault(m["path"], {})[m["ab"]] = tensor
    adapter = LoRAAdapter(name, path)
    for module, ab in sorted(pairs.items()):
        ours = rename_key(module + ".weight")
        m = _LAYER.match(ours or "")
        if m is None or m["leaf"] not in LORA_TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: unknown target module {module!r} (served: the language "
                            f"model's {sorted(LORA_TARGETS)})")
        layer, leaf = int(m["layer"]), m["leaf"]
        if layer >= cfg.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {module!r} is past the model's {cfg.num_layers} layers")
        if set(ab) != {"A", "B"}:
            missing = "A" if "B" in ab else "B"
            raise LoRAError(f"LoRA adapter {name!r}: {module!r} has no lora_{missing}")
        a, b = ab["A"].float(), ab["B"].float()
        r = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        check_pair(f"LoRA adapter {name!r}", module, leaf, a, b, r, cfg)
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", r))
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        adapter.weights[(layer, leaf)] = (a.contiguous(), (b * scale).contiguous())
    if not adapter.weights:
        raise LoRAError(f"LoRA adapter {name!r}: {path / WEIGHTS_FILE} holds no LoRA weights")
    return adapter
