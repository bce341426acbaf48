"""Test helpers: random LoRA adapters in PEFT's layout for a checkpoint, and the checkpoint with an
adapter merged into its weights (W + scale * B @ A), the reference an adapter's output must equal."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = "model.safetensors"


def projection_keys(model_dir: Path, targets: Sequence[str] = ALL_TARGETS) -> dict[str, list[int]]:
    """{checkpoint module path: [out, in]} of the language model's projections named in targets."""
    from decoder_svc.model.loader import rename_language_model_key

    out = {}
    with safe_open(str(Path(model_dir) / WEIGHTS), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
            ours = rename_language_model_key(key)
            if ours is None or not key.endswith(".weight") or key.split(".")[-2] not in targets:
                continue
            out[key.removesuffix(".weight")] = list(f.get_slice(key).get_shape())
    return out


def write_adapter(model_dir: Path, out: Path, targets: Sequence[str] = ALL_TARGETS, rank: int = 4,
                  alpha: float = 8.0, seed: int = 0, b_std: float = 0.3, rslora: bool = False,
                  config_targets: object = None) -> Path:
    """A random adapter for model_dir's language model in PEFT's layout; B is non-zero and large enough
    that greedy output changes. Returns `out`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n, k) in projection_keys(model_dir, targets).items():
        a = torch.randn(rank, k, generator=gen) / math.sqrt(k)
        b = torch.randn(n, rank, generator=gen) * b_std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "use_rslora": rslora,
              "target_modules": list(targets) if config_targets is None else config_targets}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_checkpoint(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """model_dir with the adapter merged into its weights in fp32: W + scale * B @ A. Returns `out`."""
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    lora = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    state = load_file(str(model_dir / WEIGHTS))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        w = state[module + ".weight"]
        state[module + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    shutil.copytree(model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS))
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def rounded_inner_product(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          slots: torch.Tensor, rank: int) -> torch.Tensor:
    """The reference with each row's x @ A^T rounded to x's dtype before B (PEFT's rounding points)."""
    mask = slots[:, None] == torch.arange(a.shape[0], device=x.device)[None, :] // rank
    shrunk = ((x.float() @ a.float().T) * mask).to(x.dtype).float()
    return (y.float() + shrunk @ b.float().T).to(y.dtype)
