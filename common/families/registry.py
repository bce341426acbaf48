"""The served families, one line each; lookups by checkpoint config, model directory and preset name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.checkpoint import CheckpointError, load_config
from common.families.family import ModelFamily
from common.families.gemma3 import FAMILY as GEMMA3
from common.families.llava import FAMILY as LLAVA
from common.families.phi4mm import FAMILY as PHI4MM
from common.families.qwen2_5_vl import FAMILY as QWEN2_5_VL
from common.families.qwen3_5 import FAMILY as QWEN3_5
from common.families.qwen3_5_moe import FAMILY as QWEN3_5_MOE
from common.families.qwen3_vl import FAMILY as QWEN3_VL
from common.families.qwen3_vl_moe import FAMILY as QWEN3_VL_MOE
from common.families.text import TextBackbone

FAMILIES: tuple[ModelFamily, ...] = (LLAVA, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE, GEMMA3,
                                     PHI4MM)
# Folders whose FAMILY is declared but not served yet (each one's __init__ says what is missing): no
# lookup here finds them, so their checkpoints are refused like any other unserved model_type.
NOT_SERVED_YET: tuple[str, ...] = ()
# Reads the layout of a checkpoint no family claims: LLaVA's reader refuses it naming what it serves (e.g.
# llava_next, whose tiles make the token count vary per image), the message users have always had.
FALLBACK_LAYOUT_FAMILY = LLAVA


class UnsupportedModelError(CheckpointError):
    """A checkpoint of no served family."""


def supported_model_types() -> list[str]:
    """Every model_type some family serves."""
    return [t for f in FAMILIES for t in f.model_types]


def find_family(config: dict[str, Any]) -> ModelFamily | None:
    """The family of a checkpoint's config.json (a dict), or None. A config without model_type is an
    older LLaVA export: LLaVA's."""
    model_type = config.get("model_type", "llava")
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_of(config: dict[str, Any]) -> ModelFamily:
    """The family of a checkpoint's config; UnsupportedModelError for a model_type no family serves."""
    family = find_family(config)
    if family is None:
        served = ", ".join(supported_model_types())
        model_type = config.get("model_type")
        hint = next((f"; {how}" for f in FAMILIES for form, how in f.convert_from if form == model_type), "")
        raise UnsupportedModelError(f"model_type {model_type!r} is not served{hint}; served: {served}")
    return family


def layout_family(config: dict[str, Any]) -> ModelFamily:
    """The family whose layout reads a checkpoint's config (FALLBACK_LAYOUT_FAMILY for one no family
    claims, so that the refusal says why)."""
    return find_family(config) or FALLBACK_LAYOUT_FAMILY


def text_backbones() -> list[TextBackbone]:
    """Every served family's text backbones, each once (families share some), in registry order."""
    found: list[TextBackbone] = []
    for family in FAMILIES:
        found += [b for b in family.text_spec().backbones if b not in found]
    return found


def text_backbone(model_type: str) -> TextBackbone | None:
    """The backbone that reads a text config of this model_type (the first family's that declares it),
    or None."""
    return next((b for b in text_backbones() if model_type in b.model_types), None)


def supported_text_model_types() -> list[str]:
    """Every text config model_type some family's backbone reads."""
    return [t for b in text_backbones() for t in b.model_types]


def language_weight_prefixes() -> list[tuple[str, str]]:
    """(checkpoint prefix, ours) of the language model's weights over every served family, each once, the
    longest first so that the most specific prefix wins. One map for all checkpoints: a tensor name is
    mapped the same way wherever it is read (the loader, LoRA adapters' module paths)."""
    ours: dict[str, str] = {}
    for family in FAMILIES:
        for src, dst in family.text_spec().weight_prefixes:
            if ours.setdefault(src, dst) != dst:
                raise ValueError(f"weight prefix {src!r} is mapped to both {ours[src]!r} and {dst!r}")
    return sorted(ours.items(), key=lambda pair: -len(pair[0]))


def family_of_model(model_dir: str | Path) -> ModelFamily:
    """The family of the checkpoint in model_dir (its config.json)."""
    return family_of(load_config(model_dir))


def family_by_name(name: str) -> ModelFamily:
    """A family by its folder's name; KeyError when there is none."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(name)


def preset_names() -> list[str]:
    """Every `make-model` preset, family by family in registry order."""
    return [name for f in FAMILIES for name in f.preset_names()]


def family_for_preset(preset: str) -> ModelFamily:
    """The family whose maker writes preset; ValueError naming the presets when none does."""
    for family in FAMILIES:
        if preset in family.preset_names():
            return family
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(preset_names())}")
