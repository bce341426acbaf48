"""`--device auto` and `--dtype auto`: the host's device and the checkpoint's precision, as vLLM picks them.

    device auto: cuda when torch sees a GPU, else cpu
    dtype auto:  the checkpoint's torch_dtype on a GPU (float32 when it names none we serve), float32 on CPU

A device torch cannot use (`cuda` on a CPU build of torch, `cuda:3` on a host with two GPUs) is a
ValueError whose one-line message says what to do instead; the command line shows it as its usage error.
"""

from __future__ import annotations

import json
from pathlib import Path

AUTO = "auto"
SERVED_DTYPES = ("float32", "float16", "bfloat16")
# torch_dtype aliases some checkpoints write.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def _torch_cuda() -> tuple[str, bool, int]:
    """(torch version, CUDA usable, device count), imported only when a device must be chosen."""
    import torch

    available = torch.cuda.is_available()
    return torch.__version__, available, torch.cuda.device_count() if available else 0


def resolve_device(spec: str) -> str:
    """The device to run on for `--device spec` (auto, cpu, cuda or cuda:N); ValueError (one line, with
    the fix) for one torch cannot use here."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return "cpu"
    if spec != AUTO and spec != "cuda" and not spec.startswith("cuda:"):
        raise ValueError(f"--device {spec}: unknown device; use auto, cpu, cuda or cuda:N")
    version, available, count = _torch_cuda()
    if spec == AUTO:
        return "cuda" if available else "cpu"
    if not available:
        why = "is a CPU build" if "+cpu" in version or "cu" not in version else "sees no GPU"
        raise ValueError(f"--device {spec}: torch {version} {why}; install a CUDA build of torch (README: "
                         "GPU install) or use --device auto")
    index = spec.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"--device {spec}: this host has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return spec


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype the checkpoint's config.json names (`torch_dtype`, or `dtype` as newer transformers
    write it; the text config's when the top level has none), if it is one we serve."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for where in (config, config.get("text_config") or {}):
        name = where.get("torch_dtype") or where.get("dtype")
        if isinstance(name, str):
            name = _DTYPE_ALIASES.get(name.lower(), name.lower())
            return name if name in SERVED_DTYPES else None
    return None


def resolve_dtype(spec: str, device: str, model: str | Path | None) -> str:
    """The dtype for `--dtype spec` on `device`: auto is float32 on CPU and the checkpoint's dtype on a
    GPU. Stays "auto" when the checkpoint is not on disk yet (a Hub id before it is resolved): call again
    with the local directory."""
    if spec != AUTO:
        return spec
    if device == "cpu":
        return "float32"
    if device == AUTO or model is None or not (Path(model) / "config.json").is_file():
        return AUTO
    return checkpoint_dtype(model) or "float32"


def resolve_device_and_dtype(config: object) -> None:
    """Resolve a config's `device` and `dtype` fields in place (its `model` is the checkpoint); called
    from the configs' __post_init__, so a config made in code resolves as one made from flags does."""
    config.device = resolve_device(config.device)  # type: ignore[attr-defined]
    config.dtype = resolve_dtype(config.dtype, config.device, config.model)  # type: ignore[attr-defined]
