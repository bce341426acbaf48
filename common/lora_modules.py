"""`--lora-modules` items, one parser for every command that takes them (the decoder, the gateway and
`mmserve up`, which hands its items to both): `NAME`, `NAME=PATH`, or vLLM's JSON form
`{"name": NAME, "path": PATH, "base_model_name": BASE}`. The decoder loads each adapter from its PATH, so
it needs one (`adapter_paths`); the gateway only needs each name (what a request's `model` selects) and
what `/v1/models` lists for it (`lora_modules_by_name`). A name given twice is refused everywhere."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

_JSON_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter a request may name: `path` is its card's root, `base_model_name` its card's parent
    (None: the first served name)."""

    name: str
    path: str | None = None
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` item; ValueError (one line, naming the item) when it is malformed."""
    if text.lstrip()[:1] in ("{", "["):  # JSON, never an adapter name
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"--lora-modules: {text!r} has no adapter name (expected NAME, NAME=PATH or "
                         '{"name": ..., "path": ...})')
    return LoRAModule(name, path if sep else None)


def _from_json(text: str) -> LoRAModule:
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {exc}") from None
    if not isinstance(item, dict):
        raise ValueError(f"--lora-modules: {text!r} must be a JSON object")
    unknown = [key for key in item if key not in _JSON_KEYS]
    if unknown:
        raise ValueError(f"--lora-modules: {text!r}: unknown key {unknown[0]!r} (the keys are "
                         f"{', '.join(_JSON_KEYS)})")
    for key in _JSON_KEYS:
        if key in item and not (isinstance(item[key], str) and item[key]) and item[key] is not None:
            raise ValueError(f"--lora-modules: {text!r}: {key} must be a non-empty string")
    name = item.get("name")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"--lora-modules: {text!r} has no adapter name (its \"name\" key)")
    if not item.get("path"):
        raise ValueError(f"--lora-modules: {text!r} has no \"path\" (vLLM's JSON form requires one)")
    return LoRAModule(name, item["path"], item.get("base_model_name"))


def lora_modules_by_name(items: Iterable[str]) -> dict[str, LoRAModule]:
    """{name: LoRAModule} in flag order; ValueError for a malformed item or a name given twice."""
    out: dict[str, LoRAModule] = {}
    for text in items:
        module = parse_lora_module(text)
        if module.name in out:
            raise ValueError(f"--lora-modules: adapter {module.name!r} is given twice")
        out[module.name] = module
    return out


def adapter_paths(items: Iterable[str]) -> dict[str, str]:
    """{name: adapter directory} in flag order, for the decoder: every item names its PATH (`NAME=PATH` or
    JSON; base_model_name is the gateway's and ignored here); ValueError (one line, naming the item) for a
    malformed item, one without a path, or a name given twice."""
    items = list(items)
    out: dict[str, str] = {}
    for text, module in zip(items, lora_modules_by_name(items).values(), strict=True):
        if not module.path or not module.path.strip():
            raise ValueError(f"--lora-modules: {text!r}: expected NAME=PATH or "
                             '{"name": ..., "path": ...} (a PEFT adapter directory)')
        out[module.name] = module.path
    return out
