"""Read a LoRA adapter in PEFT's directory layout, for the language model's projections.

The layout (what PEFT's `save_pretrained` writes): `adapter_config.json` with `r`, `lora_alpha`,
`target_modules` (a list of module names, or a regex string) and optionally `rank_pattern`,
`alpha_pattern`, `use_rslora`; `adapter_model.safetensors` with `<path>.lora_A.weight` [r, in] and
`<path>.lora_B.weight` [out, r] per adapted module, `<path>` the module's path in the base model under
`base_model.model.`. The path is renamed as the base checkpoint's keys are (the loader passes its
rename_language_model_key in), so an adapter for any layout the loader reads (LLaVA's, Qwen-VL's, Gemma 3's)
maps onto our layers.

Served targets: the attention's q/k/v/o and the MLP's gate/up/down projections, or the fused qkv_proj and
gate_up_proj as Phi-4 names them. A mixture-of-experts layer's MLP (its experts, per expert or stacked via
PEFT's `target_parameters`, and its router) is refused with a LoRAError that says so. Each module's
scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into its B here. Anything else (another
PEFT type, another language-model module, DoRA, LoRA biases, fan-in-fan-out weights, modules to save, a
tensor whose rank or shape does not match, a config field of the wrong type, a weight that is NaN or Inf
or overflows the serving dtype) is refused with a one-line LoRAError at start-up that names the file and
the field or tensor.

Modules outside the language model (PEFT's usual `target_modules=["q_proj", "v_proj"]` also matches a
vision tower's projections) are left out: the language model's part is served and one log line at start-up
names what was left out, as vLLM does.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.checkpoint import CheckpointError
from decoder_svc.model.config import TextModelConfig

log = logging.getLogger("mmserve.decoder.lora")

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
_MOE_MODULES = {"gate", "experts", "router", "shared_expert", "shared_expert_gate"}  # MoE MLPs' module names
_MLP = re.compile(r"^layers\.(?P<layer>\d+)\.mlp\.")  # any module of a layer's MLP (experts, router)


class LoRAError(CheckpointError):
    """An adapter this server cannot serve: refused at start-up with this message."""


@dataclass
class LoRAAdapter:
    """One adapter: per (layer, checkpoint module name), A [r, in] and B [out, r] with the scaling folded
    into B, in fp32 on the CPU."""

    name: str
    path: Path
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # its modules outside the language model

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
    for ab, t in (("A", a), ("B", b)):
        if t.dim() != 2:
            raise LoRAError(f"{who}: lora_{ab} of {module!r} has {t.dim()} dimensions {list(t.shape)}; "
                            "a LoRA weight is a matrix")
    if a.shape[0] != r or b.dim() != 2 or b.shape[1] != r:
        raise LoRAError(f"{who}: rank mismatch at {module!r}: lora_A {list(a.shape)}, "
                        f"lora_B {list(b.shape)}, but r = {r}")
    if a.shape[1] != inp or b.shape[0] != out:
        raise LoRAError(f"{who}: {module!r} is [{b.shape[0]} x {a.shape[1]}], the "
                        f"model's {leaf} is [{out} x {inp}]: an adapter for another model?")


def _short(value: object) -> str:
    """value's repr cut to one short line (a config may hold anything)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_alpha(who: str, where: str, value: object) -> float:
    """value as a float; LoRAError unless it is a finite number (not a string, null, list or bool)."""
    if not _is_number(value):
        raise LoRAError(f"{who}: {where}: `lora_alpha` must be a finite number, not {_short(value)}")
    return float(value)


def _check_pattern(who: str, where: str, key: str, value: object, valid, what: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise LoRAError(f"{who}: {where}: `{key}` must be an object of module pattern -> {what}, not "
                        f"{_short(value)}")
    for pattern, item in value.items():
        try:
            re.compile(pattern)
        except re.error as exc:
            raise LoRAError(f"{who}: {where}: `{key}` pattern {_short(pattern)} is not a regex: "
                            f"{exc}") from exc
        if not valid(item):
            raise LoRAError(f"{who}: {where}: `{key}[{_short(pattern)}]` must be {what}, not {_short(item)}")


def _read_config(path: Path, name: str) -> dict:
    who = f"LoRA adapter {name!r}"
    if not path.is_dir():
        raise LoRAError(f"{who}: {path} is not a directory (PEFT's layout: {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / needed).is_file():
            raise LoRAError(f"{who}: {path} has no {needed}")
    where = str(path / CONFIG_FILE)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise LoRAError(f"{who}: {where} is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{who}: {where} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise LoRAError(f"{who}: {where}: `peft_type` {_short(peft_type)} is not LoRA (only LORA is served)")
    if not _is_rank(config.get("r")):
        raise LoRAError(f"{who}: {where}: needs a positive integer `r`, not {_short(config.get('r'))}")
    if "lora_alpha" in config:
        check_alpha(who, where, config["lora_alpha"])
    _check_pattern(who, where, "rank_pattern", config.get("rank_pattern"), _is_rank, "a positive integer")
    _check_pattern(who, where, "alpha_pattern", config.get("alpha_pattern"), _is_number, "a finite number")
    if config.get("use_rslora") not in (None, True, False):
        raise LoRAError(f"{who}: {where}: `use_rslora` must be true or false, not "
                        f"{_short(config['use_rslora'])}")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan-in-fan-out weights", "modules_to_save": "modules "
               "to save", "use_qalora": "QA-LoRA",
               "target_parameters": "LoRA on parameters (e.g. a mixture-of-experts layer's stacked experts)"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{who}: {what} ({key}) is not served")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{who}: LoRA biases (bias={_short(config['bias'])}) are not served")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise LoRAError(f"{who}: {where}: `target_modules` {_short(targets)} is not a regex: "
                            f"{exc}") from exc
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown:
            moe = ("; LoRA on mixture-of-experts layers (their router and experts) is not served"
                   if set(unknown) & _MOE_MODULES else "")
            raise LoRAError(f"{who}: unknown target module(s) {unknown}; served: {sorted(LORA_TARGETS)}{moe}")
    elif targets is not None:
        raise LoRAError(f"{who}: {where}: `target_modules` must be a list of module names or a regex "
                        f"string, not {_short(targets)}")
    return config


def check_finite(who: str, what: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """LoRAError unless every value of tensor is finite, in fp32 and (dtype: the serving dtype) once cast
    to dtype: an fp16 model cannot hold a weight above 65504. A NaN in any adapter must never load (a
    step's product over several adapters must not meet one)."""
    if not torch.isfinite(tensor).all():
        raise LoRAError(f"{who}: {what} holds NaN or Inf")
    if dtype is not None and tensor.is_floating_point() and not torch.isfinite(tensor.to(dtype)).all():
        raise LoRAError(f"{who}: {what} overflows {str(dtype).removeprefix('torch.')} (largest |value| "
                        f"{tensor.abs().max().item():.4g})")


def _summary(modules: list[str]) -> str:
    """Module paths with their layer numbers folded (`...layers.*.self_attn.q_proj`), a few at most."""
    folded = sorted({re.sub(r"\.\d+\.", ".*.", m) for m in modules})
    return ", ".join(folded[:6]) + (f" and {len(folded) - 6} more" if len(folded) > 6 else "")


def _pattern_value(pattern: dict, path: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the module's path."""
    for key, value in (pattern or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", path):
            return value
    return default


def load_adapter(name: str, path: str | Path, cfg: TextModelConfig, rename_key: KeyRenamer,
                 dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Read and check the adapter at `path` against the language model's (whole) config `cfg`; its module
    paths are named as the base checkpoint's keys, which `rename_key` maps to ours
    (loader.rename_language_model_key: passed in, as the loader imports this module); dtype: the dtype the
    model serves in (its weights must fit it)."""
    from safetensors.torch import load_file

    path = Path(path)
    who, file = f"LoRA adapter {name!r}", path / WEIGHTS_FILE
    config = _read_config(path, name)
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which adapter
        raise LoRAError(f"{who}: cannot read {file}: {str(exc)[:200]}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{who}: tensor {key!r} is not a lora_A/lora_B weight "
                            "(embedding adapters and saved modules are not served)")
        if not tensor.is_floating_point():
            raise LoRAError(f"{who}: {file}: tensor {key!r} is {tensor.dtype}, not floating point")
        if tensor.dim() != 2:
            raise LoRAError(f"{who}: {file}: tensor {key!r} has {tensor.dim()} dimensions "
                            f"{list(tensor.shape)}; a LoRA weight is a matrix")
        check_finite(who, f"{file}: tensor {key!r}", tensor, dtype)
        pairs.setdefault(m["path"], {})[m["ab"]] = tensor
    adapter = LoRAAdapter(name, path)
    for module, ab in sorted(pairs.items()):
        ours = rename_key(module + ".weight")
        if ours is None:  # the vision tower's or projector's module: not ours to serve
            adapter.left_out.append(module)
            continue
        mlp = _MLP.match(ours)
        if mlp is not None and cfg.layer_is_moe(int(mlp["layer"])):
            raise LoRAError(f"{who}: {module!r} is in a mixture-of-experts MLP; LoRA on MoE layers (their "
                            "experts and router) is not served, only on the attention's projections")
        m = _LAYER.match(ours)
        if m is None or m["leaf"] not in LORA_TARGETS:
            raise LoRAError(f"{who}: unknown target module {module!r} (served: the language "
                            f"model's {sorted(LORA_TARGETS)})")
        layer, leaf = int(m["layer"]), m["leaf"]
        if layer >= cfg.num_layers:
            raise LoRAError(f"{who}: {module!r} is past the model's {cfg.num_layers} layers")
        if set(ab) != {"A", "B"}:
            missing = "A" if "B" in ab else "B"
            raise LoRAError(f"{who}: {module!r} has no lora_{missing}")
        a, b = ab["A"].float(), ab["B"].float()
        r = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        check_pair(who, module, leaf, a, b, r, cfg)
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", r))
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        scaled = b * scale
        check_finite(who, f"{file}: tensor {module + '.lora_B.weight'!r} times its scale {scale:.4g}", scaled,
                     dtype)
        adapter.weights[(layer, leaf)] = (a.contiguous(), scaled.contiguous())
    if not adapter.weights:
        raise LoRAError(f"{who}: {file} holds no LoRA weights for the language model"
                        + (f" (only {_summary(adapter.left_out)})" if adapter.left_out else ""))
    if adapter.left_out:
        log.warning("LoRA adapter %r: serving the language model's modules; left out %d outside it: %s",
                    name, len(adapter.left_out), _summary(adapter.left_out))
    return adapter
