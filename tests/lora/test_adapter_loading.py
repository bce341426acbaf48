"""Adapters are read in PEFT's layout and refused at start-up, with a message naming the adapter and the
problem, when missing, malformed, of another rank or shape, or aimed at a module we do not serve."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoder_svc.engine import EngineConfig
from decoder_svc.main import build_arg_parser
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import rename_language_model_key, text_config_dict
from decoder_svc.model.lora import LoRAError, load_adapter
from tests.lora.adapters import write_adapter


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return TextModelConfig.from_hf(text_config_dict(tiny_model_dir))


def _edit(path, config=None, tensors=None):
    if config is not None:
        data = json.loads((path / "adapter_config.json").read_text())
        data.update(config)
        (path / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(str(path / "adapter_model.safetensors"))
        save_file(tensors(state), str(path / "adapter_model.safetensors"))
    return path


def _remove(path, name):
    (path / name).unlink()
    return path


def _garble(path, name):
    (path / name).write_text("{oops")
    return path


def test_reads_peft_layout_and_folds_the_scale(tiny_model_dir, cfg, tmp_path):
    path = write_adapter(tiny_model_dir, tmp_path / "a", targets=("q_proj", "down_proj"), rank=4, alpha=8)
    adapter = load_adapter("a", path, cfg, rename_language_model_key)
    assert {leaf for _, leaf in adapter.weights} == {"q_proj", "down_proj"}
    assert adapter.max_rank == 4 and len(adapter.weights) == 2 * cfg.num_layers
    raw = load_file(str(path / "adapter_model.safetensors"))
    b = raw["base_model.model.language_model.model.layers.1.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[(1, "down_proj")][1], b * 2.0)  # alpha / r


@pytest.mark.parametrize(("edit", "message"), [
    (lambda p: p / "missing", "is not a directory"),
    (lambda p: _remove(p, "adapter_model.safetensors"), "has no adapter_model.safetensors"),
    (lambda p: _garble(p, "adapter_config.json"), "is not valid JSON"),
    (lambda p: _edit(p, {"r": 0}), "positive integer `r`"),
    (lambda p: _edit(p, {"r": 8}), "rank mismatch"),
    (lambda p: _edit(p, {"target_modules": ["q_proj", "lm_head"]}),
     r"unknown target module\(s\) \['lm_head'\]"),
    (lambda p: _edit(p, {"use_dora": True}), "DoRA"),
    (lambda p: _edit(p, {"bias": "all"}), "LoRA biases"),
    (lambda p: _edit(p, tensors=lambda s: {k.replace("q_proj", "rotary"): v for k, v in s.items()}),
     "unknown target module"),
    (lambda p: _edit(p, tensors=lambda s: {k: v for k, v in s.items() if "lora_B" not in k}), "no lora_B"),
    (lambda p: _edit(p, tensors=lambda s: {k: torch.zeros(v.shape[0], 3) if "lora_A" in k else v
                                           for k, v in s.items()}), "an adapter for another model"),
])
def test_refused_with_a_clear_message(tiny_model_dir, cfg, tmp_path, edit, message):
    path = edit(write_adapter(tiny_model_dir, tmp_path / "bad", targets=("q_proj",)))
    with pytest.raises(LoRAError, match=message) as err:
        load_adapter("bad", path, cfg, rename_language_model_key)
    assert "'bad'" in str(err.value)


def test_flags_and_config(tiny_model_dir, tmp_path):
    path = write_adapter(tiny_model_dir, tmp_path / "a")
    args = build_arg_parser().parse_args(["--model", str(tiny_model_dir), "--lora-modules", f"a={path}",
                                          f"b={path}"])
    assert args.lora_modules == [f"a={path}", f"b={path}"]
    config = EngineConfig(model=tiny_model_dir, lora_modules={"a": str(path)})
    assert config.lora_adapters == {"a": str(path)}
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(model=tiny_model_dir, lora_modules=[f"a={path}", f"a={path}"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(model=tiny_model_dir, lora_modules=["a"])


def test_decoder_start_up_refuses_a_bad_adapter(tiny_model_dir, tmp_path):
    from tests.cli_errors import assert_usage_error, run_cli

    path = _edit(write_adapter(tiny_model_dir, tmp_path / "wide", targets=("q_proj",)), {"r": 8})
    result = run_cli("decoder", "--encoder", "127.0.0.1:1", "--model", str(tiny_model_dir), "--port", "0",
                     "--lora-modules", f"wide={path}", timeout=120)
    assert_usage_error(result, "--lora-modules: LoRA adapter 'wide': rank mismatch")


def test_a_fused_target_stacks_as_its_parts(cfg):
    """Phi-4 names its adapters' targets qkv_proj and gate_up_proj (fused already): an adapter on the fused
    module with A = [A_q; A_k; A_v] and a block-diagonal B computes what one on q/k/v computes."""
    from pathlib import Path

    from decoder_svc.model.lora import LoRAAdapter
    from decoder_svc.model.lora.adapter import module_dims
    from decoder_svc.model.lora.batched import stack_module

    gen = torch.Generator().manual_seed(3)
    parts = {leaf: (torch.randn(2, cfg.hidden_size, generator=gen),
                    torch.randn(module_dims(leaf, cfg)[0], 2, generator=gen)) for leaf in ("q_proj", "k_proj",
                                                                                         "v_proj")}
    split = LoRAAdapter("split", Path("."), {(0, leaf): ab for leaf, ab in parts.items()})
    fused = LoRAAdapter("fused", Path("."), {(0, "qkv_proj"): (
        torch.cat([a for a, _ in parts.values()]), torch.block_diag(*[b for _, b in parts.values()]))})
    x = torch.randn(3, cfg.hidden_size)
    deltas = []
    for adapter in (split, fused):
        a, b, rank = stack_module(0, "qkv_proj", [adapter], cfg, torch.float32, "cpu")
        deltas.append((x @ a[rank:].T) @ b[:, rank:].T)
    torch.testing.assert_close(deltas[0], deltas[1])
    assert stack_module(0, "o_proj", [split], cfg, torch.float32, "cpu") is None
