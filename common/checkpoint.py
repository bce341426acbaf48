"""Reading a checkpoint directory (any served family): config, fingerprint and selected tensors.

Each service loads only its own part of the weights (the encoder the vision tower and projector, the
decoder the language model), straight from the safetensors files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from common.processor_settings import processor_settings_bytes

_FINGERPRINT_SAMPLE = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint this server cannot serve: the services refuse it at start-up with this message."""


def load_config(model_dir: str | Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory: no config.json")
    return json.loads(path.read_text())


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files, in a stable order."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hex id of the checkpoint: config, processor settings, and the head and tail of every
    weight file.

    Two checkpoints that differ in config, in any processor setting that can change an image's pixels
    (common/processor_settings.py) or in weights get different fingerprints, so their embeddings never
    share a cache key. Reading only 2 MiB per file keeps this cheap for a 7B checkpoint. A
    directory without weight files (served with `--load-format dummy`) is fingerprinted by its config.
    """
    h = hashlib.sha256()
    h.update((Path(model_dir) / "config.json").read_bytes())
    h.update(processor_settings_bytes(model_dir))
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_FINGERPRINT_SAMPLE))
            f.seek(max(0, size - _FINGERPRINT_SAMPLE))
            h.update(f.read(_FINGERPRINT_SAMPLE))
    return h.hexdigest()[:16]


def load_tensors(
    model_dir: str | Path,
    prefixes: Iterable[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    slicer: Callable[[str, list[int]], tuple[slice, ...] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors whose names start with any of prefixes, keyed by their full names.

    Only the matching tensors are read from disk; floating tensors are cast to dtype when given.
    `slicer(name, shape)` may name the part of a tensor to read (a tensor-parallel rank's shard): only
    those bytes are read. None reads it whole.
    """
    from safetensors import safe_open

    prefixes = tuple(prefixes)
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    part = slicer(name, f.get_slice(name).get_shape()) if slicer is not None else None
                    t = f.get_tensor(name) if part is None else f.get_slice(name)[part]
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    out[name] = t
    return out


def parse_dtype(name: str) -> torch.dtype:
    """torch dtype from "float32"/"fp32", "float16"/"fp16"/"half", "bfloat16"/"bf16"."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use float32, float16 or bfloat16") from None
