"""argparse `type=` functions shared by every command and by the config dataclasses' options: a bad
value exits 2 with one "error: argument ..." line, before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from common.lora_modules import adapter_paths


def int_in_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in some messages
    return parse


positive_int = int_in_range(1)
non_negative_int = int_in_range(0)
port_number = int_in_range(0, 65535)


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (seconds, mostly)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def dtype_name(text: str) -> str:
    """An argparse type: a dtype alias (fp16, bf16, ...) as its torch name ("float16", ...), or "auto"
    (common/devices.py: the checkpoint's dtype on a GPU, float32 on CPU)."""
    if text.strip().lower() == "auto":
        return "auto"
    from common.checkpoint import parse_dtype  # imports torch: only commands that need it get here

    try:
        return str(parse_dtype(text)).removeprefix("torch.")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_name(text: str) -> str:
    """An argparse type: auto, cpu, cuda or cuda:N (lower-cased). Whether torch can use it is checked
    when the config resolves it (common/devices.py resolve_device), with the fix in the message."""
    name = text.strip().lower()
    if name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N")


def model_dir(text: str) -> str:
    """An argparse type: a checkpoint directory (config.json; its weights are checked by
    `require_local_weights`, which a service's config calls unless it draws dummy weights) or a Hugging
    Face Hub id (owner/name, resolved later by resolve_model_arg). A local directory is checked before
    anything loads so that a typo fails in a second rather than after the imports."""
    from common.hub import ModelNotFoundError, check_checkpoint_dir, is_hub_id

    if is_hub_id(text):
        return text
    try:
        check_checkpoint_dir(Path(text).expanduser(), text, require_weights=False)
    except ModelNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def require_local_weights(model: str | Path, hint: str = "") -> None:
    """ValueError naming --model when `model` is a local directory without *.safetensors weights (a Hub
    id's snapshot is checked when it is resolved)."""
    from common.hub import ModelNotFoundError, check_checkpoint_dir, is_hub_id

    if is_hub_id(str(model)):
        return
    try:
        check_checkpoint_dir(Path(model).expanduser(), str(model))
    except ModelNotFoundError as exc:
        raise ValueError(f"--model: {exc}{hint}") from None




def lora_module(text: str) -> str:
    """An argparse type: one decoder `--lora-modules` item, `NAME=PATH` or vLLM's JSON form
    `{"name": NAME, "path": PATH, "base_model_name": BASE}` (common/lora_modules.py), returned as given.
    NAME is what a request sends to select it: no spaces, not empty; PATH a PEFT adapter directory."""
    try:
        adapter_paths([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--lora-modules: ")) from None
    return text


def lora_modules_dict(items: list[str]) -> dict[str, str]:
    """{name: path} of decoder `--lora-modules` items (lora_module's forms); ValueError for a malformed
    item or a name given twice."""
    return adapter_paths(items)
