"""Load only the language-model tensors of a checkpoint into our LlamaForCausalLM.

Which tensors those are, and their names in our modules, the families declare: each family's TextSpec
(common/families/<name>/text.py) lists its checkpoints' weight prefixes, and a tensor under none of them
(a vision tower, a projector) is not read. Checkpoints whose layers store `qkv_proj` / `gate_up_proj`
fused already match our fused modules (in q|k|v and gate|up row order); separate q/k/v and gate/up
tensors are packed into them here. LoRA-wrapped layers in the base checkpoint (PEFT's naming) give their
base weight; their adapter tensors are skipped here (rename_language_model_key) and read as adapters
(model/lora/builtin.py). Under tensor parallelism the fused tensors are sliced per part
(parallel.shard_slices' fused rows)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.checkpoint import CheckpointError, load_config, load_tensors
from common.families.registry import language_weight_prefixes
from decoder_svc.model.backends import make_kernels
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.dummy import dummy_state
from decoder_svc.model.llama import LlamaForCausalLM, mrope_axes
from decoder_svc.model.lora import LoRAError, attach_adapters, load_adapter
from decoder_svc.model.lora.builtin import builtin_adapter_names, load_builtin_adapter
from decoder_svc.model.lora.merged import maybe_merge_builtin
from decoder_svc.model.moe import expert_weights_from_checkpoint
from decoder_svc.model.parallel import (
    TensorParallel,
    finish_shard,
    max_over_ranks,
    shard_fp8_scale,
    shard_slices,
)
from decoder_svc.model.quant.experts import (
    is_expert_scale,
    quantize_experts,
    refuse_fp8_experts,
    swap_in_fp8_experts,
)
from decoder_svc.model.quant.formats import checkpoint_fp8_format
from decoder_svc.model.quant.fp8 import FP8_DTYPE
from decoder_svc.model.quant.linear import swap_in_fp8
from decoder_svc.model.quant.load import (
    SCALE,
    align_shard_blocks,
    check_all_or_none,
    quantize_projections,
    read_fp8_checkpoint,
)

# Checkpoint module -> (our fused module, shard index): shards are concatenated along the output rows.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def text_config_dict(model_dir: str | Path) -> dict:
    """The text_config with transformers' defaults filled in (many VLM configs list only overrides)."""
    raw = load_config(model_dir)
    text = dict(raw.get("text_config") or raw)
    try:
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        text = {**full.get_text_config().to_dict(), **text}
    except Exception:  # noqa: BLE001 - a config transformers cannot read: use the raw dict as is
        pass
    if "tie_word_embeddings" not in (raw.get("text_config") or {}) and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def rename_language_model_key(name: str, prefixes: list[tuple[str, str]] | None = None) -> str | None:
    """Our parameter name for a checkpoint key, or None when the key is not language-model weight.
    `prefixes`: (checkpoint prefix, ours), most specific first; None: every family's
    (registry.language_weight_prefixes). LoRA-wrapped layers (PEFT's naming, as some checkpoints store
    their own adapters inside the base weights): the base weight under `<module>.base_layer.` is the
    module's own; the adapters' `lora_A` / `lora_B` tensors are not base weight (a family's
    checkpoint_adapters are read by model/lora/builtin.py and served per request; the others are not)."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    name = name.replace(".base_layer.", ".")
    for src, dst in language_weight_prefixes() if prefixes is None else prefixes:
        if name.startswith(src):
            return dst + name[len(src):]
    return None


def pack_fused_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate q/k/v and gate/up tensors (weights and biases) into our fused modules' tensors."""
    packed: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        parts = name.split(".")
        fused = PACKED_MODULES.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            packed[name] = tensor
            continue
        target = ".".join([*parts[:-2], fused[0], parts[-1]])
        shards.setdefault(target, {})[fused[1]] = tensor
    for target, by_index in shards.items():
        expected = 3 if ".qkv_proj." in target else 2
        if sorted(by_index) != list(range(expected)):
            raise ValueError(f"checkpoint has {len(by_index)} of the {expected} shards of {target}")
        packed[target] = torch.cat([by_index[i] for i in range(expected)], dim=0)
    return packed


LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("none", "fp8")


def _check_has_language_weights(model_dir: str | Path) -> None:
    """A checkpoint made with `make-model --weights vision` holds no language model: say how to serve it."""
    made = Path(model_dir) / "mmserve_model.json"
    if made.exists() and json.loads(made.read_text()).get("language_weights") is False:
        raise CheckpointError(f"{model_dir} holds only the vision tower's weights (make-model --weights "
                              "vision): serve its language model with --load-format dummy")


def load_language_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    quantization: str = "none",
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    lora_modules: dict[str, str] | None = None,
    deterministic: bool = False,
    merge_builtin_adapter: bool = True,
) -> LlamaForCausalLM:
    """Build the model from the checkpoint's text config and load its weights (strictly), with the
    kernels `attention_backend` names (backends.make_kernels: auto, torch or triton).

    quantization "fp8" quantizes the decoder layers' projections (and a MoE layer's experts, per expert:
    quant/experts.py) per output channel at load; an FP8 checkpoint (quant.formats) is served in FP8
    whatever it says (FP8-quantized experts are refused). load_format "dummy" draws random
    weights on the device (model/dummy.py) instead of reading weight files. `tp` (size > 1): this rank's
    shard of every layer, read as slices of the checkpoint's tensors (model/parallel.py). `lora_modules`
    (name -> PEFT adapter directory): the adapters, read and checked before any weight is, then attached
    in that order as slots 1.. (model/lora/), then the checkpoint's own adapters (lora/builtin.py).
    `deterministic`: batch-invariant kernels and products (model/batch_invariant.py); ValueError with
    tensor parallelism or FP8 projections, which it does not cover. `merge_builtin_adapter`: the
    checkpoint's own adapter (its first) also gets merged copies of the projections it targets, which the
    steps whose rows all run it use (lora/merged.py); never in the deterministic mode (a row's products
    would then follow its step's company) nor with FP8 projections."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose from {LOAD_FORMATS}")
    cfg = TextModelConfig.from_hf(text_config_dict(model_dir))
    fmt = checkpoint_fp8_format(load_config(model_dir))
    tp = tp if tp is not None and tp.size > 1 else None
    fp8 = quantization == "fp8" or fmt is not None
    if deterministic:
        _check_deterministic(quantization, fmt, tp)
    backend, ops = make_kernels(attention_backend, device, deterministic)
    if tp is not None:
        tp.check(cfg)
    full_cfg = cfg
    builtin = _builtin_adapter_names(model_dir, set(lora_modules or {}))
    rename = rename_language_model_key  # adapters name modules as the checkpoint does
    adapters = [load_adapter(name, path, cfg, rename, dtype) for name, path in (lora_modules or {}).items()]
    adapters += [load_builtin_adapter(model_dir, name, cfg, load_format == "dummy", dtype, rename_key=rename)
                 for name in builtin]
    with torch.device("meta"):
        model = LlamaForCausalLM(tp.local_config(cfg) if tp else cfg, backend, ops, tp)
    cfg = model.config
    draw_in_place = load_format == "dummy" and quantization == "none"
    if load_format == "dummy":
        # Drawn per tensor from its name, so the replicated ones are the same on every rank. Unquantized,
        # into the allocated model (below): the drawn state and the model never both take memory (a 30B
        # MoE's 2 x 61 GB would not fit one 80 GB GPU).
        shapes = {n: p.shape for n, p in model.named_parameters()}
        state = {} if draw_in_place else dummy_state(shapes, cfg.num_layers,
                                                     cfg.tie_word_embeddings and tp is None, device, dtype)
        fmt = None  # nothing is read, so nothing is FP8 yet
    else:
        _check_has_language_weights(model_dir)
        state = _checkpoint_state(model_dir, full_cfg, tp)
        if fmt is not None:
            refuse_fp8_experts(state, fmt)
        expert_weights_from_checkpoint(state, full_cfg)
    blocks: dict = {}
    fp8_experts: list[str] = []
    if fmt is not None:
        shard = (lambda module, scale, local: shard_fp8_scale(module, scale, fmt, local, full_cfg, tp)) \
            if tp is not None else None
        blocks = align_shard_blocks(state, read_fp8_checkpoint(state, fmt, dtype, PACKED_MODULES, shard),
                                    PACKED_MODULES)
        check_all_or_none(state, blocks, PACKED_MODULES)
    state = pack_fused_weights(state)
    if quantization == "fp8" and fmt is None:
        # From the checkpoint's own precision; with TP, each row's scale over every rank's columns.
        blocks = quantize_projections(state, device, max_over_ranks if tp is not None else None)
        fp8_experts = quantize_experts(state, device)
    state = {n: t.to(dtype) if t.is_floating_point() and t.dtype != FP8_DTYPE and not n.endswith(SCALE)
             and not is_expert_scale(n) else t for n, t in state.items()}
    tie = (cfg.tie_word_embeddings or ("lm_head.weight" not in state and not draw_in_place)) \
        and model.tp is None
    if tie:
        state.pop("lm_head.weight", None)
    model = model.to(dtype)  # still on meta: nothing allocated yet
    swap_in_fp8_experts(model, fp8_experts)  # on meta too: the experts are never allocated in `dtype`
    model = model.to_empty(device=device)
    swap_in_fp8(model, blocks, ops)  # after .to(dtype), which would cast FP8 weights
    if draw_in_place:
        state = dummy_state(shapes, cfg.num_layers, cfg.tie_word_embeddings and tp is None, device, dtype,
                            into=dict(model.named_parameters()))
        if tie:
            state.pop("lm_head.weight", None)
    model.cos_sin = model.rotary_table(cfg).to(device)  # fp32, not in the checkpoint
    model.cos_sin_local = model.local_rotary_table(cfg).to(device)
    model.mrope_axis = mrope_axes(cfg).to(device)
    if tie:
        model.lm_head.weight = model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tie and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match the language model: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    attach_adapters(model, adapters, full_cfg)
    if builtin and merge_builtin_adapter:
        first = len(adapters) - len(builtin)
        maybe_merge_builtin(model, adapters[first], first + 1, full_cfg, _merge_refusal(deterministic, fp8))
    model.batch_invariant = deterministic
    return model.eval()


def _check_deterministic(quantization: str, fmt: object, tp: TensorParallel | None) -> None:
    """ValueError for what the deterministic mode does not make batch-invariant yet."""
    if tp is not None:
        raise ValueError("--deterministic is not supported with --tensor-parallel-size > 1 (the all-reduce's "
                         "summation order follows the batch)")
    if quantization == "fp8" or fmt is not None:
        raise ValueError("--deterministic is not supported with FP8 projections (--quantization fp8 or an "
                         "FP8 checkpoint): their kernels are chosen by the batch's rows")


def _merge_refusal(deterministic: bool, fp8: bool) -> str | None:
    """Why a built-in adapter must not be merged, or None."""
    if deterministic:
        return ("--deterministic (merged and LoRA products round differently, so a row's result would "
                "follow who else is in its step)")
    if fp8:
        return "FP8 projections (merged copies are not quantized)"
    return None


def _builtin_adapter_names(model_dir: str | Path, taken: set[str]) -> list[str]:
    """The checkpoint's own adapters' names (its family's checkpoint_adapters); LoRAError when a
    --lora-modules name takes one's name."""
    names = builtin_adapter_names(model_dir)
    clash = sorted(taken & set(names))
    if clash:
        raise LoRAError(f"LoRA adapter name(s) {clash} are the checkpoint's own adapters; choose another "
                        "name")
    return names


def _checkpoint_state(model_dir: str | Path, cfg: TextModelConfig,
                      tp: TensorParallel | None = None) -> dict[str, torch.Tensor]:
    """The language model's tensors under our names, in the checkpoint's own dtypes (FP8 stays FP8);
    with `tp`, only this rank's slices are read (model/parallel.py)."""
    prefixes = language_weight_prefixes()

    def slicer(name: str, shape: list[int]) -> tuple[slice, ...] | None:
        ours = rename_language_model_key(name, prefixes)
        return shard_slices(ours, cfg, tp) if ours is not None else None

    tensors = load_tensors(model_dir, [p for p, _ in prefixes], device="cpu",
                           slicer=slicer if tp is not None else None)
    state = {}
    for name, tensor in tensors.items():
        ours = rename_language_model_key(name, prefixes)
        if ours is not None and "rotary_emb" not in ours:
            state[ours] = tensor
    if tp is not None:
        finish_shard(state, cfg, tp)
    return state


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """EOS ids as HF generate sees them: generation_config.json first, then the text config."""
    path = Path(model_dir) / "generation_config.json"
    eos = None
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        eos = text_config_dict(model_dir).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
