"""Adapters the loader must refuse in one line naming the file and the field or tensor (malformed configs,
what is not LoRA, weights that are NaN, Inf or overflow the serving dtype, a layer past the model), what it
must honour (PEFT's alpha_pattern), and PEFT's usual recipe whose q/v targets also match the vision tower:
the language model's part served, the rest named in one log line."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import rename_language_model_key, text_config_dict
from decoder_svc.model.lora import LoRAError, load_adapter
from tests.lora.adapters import WEIGHTS, write_adapter
from tests.lora.test_adapter_loading import _edit

CONFIG, TENSORS = "adapter_config.json", "adapter_model.safetensors"
Q0 = "base_model.model.language_model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return TextModelConfig.from_hf(text_config_dict(tiny_model_dir))


def _raw_config(path, text: str):
    (path / CONFIG).write_text(text)
    return path


def _replace(key: str, tensor: torch.Tensor):
    return lambda state: {**state, key: tensor}


@pytest.mark.parametrize(("edit", "file", "field"), [
    (lambda p: _edit(p, {"lora_alpha": "sixteen"}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"lora_alpha": None}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"lora_alpha": [8]}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"lora_alpha": True}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"lora_alpha": math.nan}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"lora_alpha": math.inf}), CONFIG, "`lora_alpha`"),
    (lambda p: _edit(p, {"r": True}), CONFIG, "`r`"),
    (lambda p: _edit(p, {"r": {"value": 4}}), CONFIG, "`r`"),
    (lambda p: _edit(p, {"peft_type": "IA3"}), CONFIG, "`peft_type`"),
    (lambda p: _edit(p, {"target_modules": 7}), CONFIG, "`target_modules`"),
    (lambda p: _edit(p, {"target_modules": [7]}), CONFIG, "`target_modules`"),
    (lambda p: _edit(p, {"target_modules": "q_proj("}), CONFIG, "`target_modules`"),
    (lambda p: _edit(p, {"rank_pattern": "q_proj"}), CONFIG, "`rank_pattern`"),
    (lambda p: _edit(p, {"rank_pattern": {"q_proj": "4"}}), CONFIG, "`rank_pattern"),
    (lambda p: _edit(p, {"rank_pattern": {"q_proj": 0}}), CONFIG, "`rank_pattern"),
    (lambda p: _edit(p, {"rank_pattern": {"q_proj(": 4}}), CONFIG, "`rank_pattern`"),
    (lambda p: _edit(p, {"alpha_pattern": {"q_proj": None}}), CONFIG, "`alpha_pattern"),
    (lambda p: _edit(p, {"use_rslora": "yes"}), CONFIG, "`use_rslora`"),
    (lambda p: _raw_config(p, "[" * 100_000 + "]" * 100_000), CONFIG, "not valid JSON"),
    (lambda p: _raw_config(p, "[1, 2]"), CONFIG, "not a JSON object"),
    (lambda p: _edit(p, tensors=_replace(f"{Q0}.lora_A.weight", torch.tensor(1.0))), Q0, "lora_A"),
    (lambda p: _edit(p, tensors=_replace(f"{Q0}.lora_A.weight", torch.zeros(2, 4, 64))), Q0, "lora_A"),
    (lambda p: _edit(p, tensors=_replace(f"{Q0}.lora_B.weight", torch.zeros(64))), Q0, "lora_B"),
    (lambda p: _edit(p, tensors=lambda s: {k: v.to(torch.int32) for k, v in s.items()}), TENSORS,
     "not floating point"),
])
def test_malformed_adapters_are_refused_in_one_line(tiny_model_dir, cfg, tmp_path, edit, file, field):
    path = edit(write_adapter(tiny_model_dir, tmp_path / "bad", targets=("q_proj",)))
    with pytest.raises(LoRAError) as err:
        load_adapter("bad", path, cfg, rename_language_model_key)
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    assert "'bad'" in message and file in message and field in message, message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["A", "B"])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny_model_dir, cfg, tmp_path, value, which):
    def poison(state):
        key = f"{Q0}.lora_{which}.weight"
        tensor = state[key].clone()
        tensor[0, 1] = value
        return {**state, key: tensor}

    path = _edit(write_adapter(tiny_model_dir, tmp_path / "nan", targets=("q_proj",)), tensors=poison)
    with pytest.raises(LoRAError, match="holds NaN or Inf") as err:
        load_adapter("nan", path, cfg, rename_language_model_key)
    assert f"{Q0}.lora_{which}.weight" in str(err.value) and TENSORS in str(err.value)


def test_weights_that_overflow_the_serving_dtype_are_refused(tiny_model_dir, cfg, tmp_path):
    """Finite in fp32 but not in fp16: a B value over 65504, or one that the scale lifts over it."""
    def big(value):
        def edit(state):
            key = f"{Q0}.lora_B.weight"
            tensor = state[key].clone()
            tensor[0, 0] = value
            return {**state, key: tensor}
        return edit

    over = _edit(write_adapter(tiny_model_dir, tmp_path / "over", targets=("q_proj",)), tensors=big(7e4))
    with pytest.raises(LoRAError, match=f"{TENSORS}: tensor '{Q0}.lora_B.weight' overflows float16"):
        load_adapter("over", over, cfg, rename_language_model_key, torch.float16)
    assert load_adapter("over", over, cfg, rename_language_model_key, torch.bfloat16).weights  # bf16 holds it
    # 4e4 fits fp16, times alpha / r = 8 / 4 does not
    scaled = _edit(write_adapter(tiny_model_dir, tmp_path / "scaled", targets=("q_proj",)), tensors=big(4e4))
    with pytest.raises(LoRAError, match="times its scale 2 overflows float16"):
        load_adapter("scaled", scaled, cfg, rename_language_model_key, torch.float16)
    huge = _edit(write_adapter(tiny_model_dir, tmp_path / "huge", targets=("q_proj",)), {"lora_alpha": 1e308})
    with pytest.raises(LoRAError, match="times its scale .* holds NaN or Inf"):
        load_adapter("huge", huge, cfg, rename_language_model_key)


def test_alpha_pattern_sets_a_modules_scale(tiny_model_dir, cfg, tmp_path):
    path = _edit(write_adapter(tiny_model_dir, tmp_path / "a", targets=("q_proj", "down_proj"), rank=4,
                               alpha=8), {"alpha_pattern": {"q_proj": 16}})
    adapter = load_adapter("a", path, cfg, rename_language_model_key)
    raw = load_file(str(path / TENSORS))
    for leaf, block, scale in (("q_proj", "self_attn", 4.0), ("down_proj", "mlp", 2.0)):
        b = raw[f"base_model.model.language_model.model.layers.1.{block}.{leaf}.lora_B.weight"]
        torch.testing.assert_close(adapter.weights[(1, leaf)][1], b * scale)


def test_a_layer_past_the_model_is_refused(tiny_model_dir, cfg, tmp_path):
    """An adapter for layer num_layers is an adapter for another model, never loaded and dropped."""
    past = Q0.replace("layers.0.", f"layers.{cfg.num_layers}.")

    def extra(state):
        moved = {k.replace(Q0, past): v.clone() for k, v in state.items() if k.startswith(Q0 + ".")}
        return {**state, **moved}

    path = _edit(write_adapter(tiny_model_dir, tmp_path / "deep", targets=("q_proj",)), tensors=extra)
    with pytest.raises(LoRAError, match=f"past the model's {cfg.num_layers} layers"):
        load_adapter("deep", path, cfg, rename_language_model_key)


def _with_vision_modules(tiny_model_dir, path, only_vision: bool = False):
    """PEFT's q_proj/v_proj recipe on the whole LLaVA model: the vision tower's q/v get adapters too."""
    gen = torch.Generator().manual_seed(5)
    state = {} if only_vision else load_file(str(path / TENSORS))
    with safe_open(str(tiny_model_dir / WEIGHTS), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
            if rename_language_model_key(key) is None and key.split(".")[-2] in ("q_proj", "v_proj") \
                    and key.endswith(".weight"):
                n, k = f.get_slice(key).get_shape()
                module = "base_model.model." + key.removesuffix(".weight")
                state[f"{module}.lora_A.weight"] = torch.randn(4, k, generator=gen)
                state[f"{module}.lora_B.weight"] = torch.randn(n, 4, generator=gen)
    save_file(state, str(path / TENSORS))
    return path


def test_the_usual_recipe_serves_the_language_models_part(tiny_model_dir, cfg, tmp_path, caplog):
    path = write_adapter(tiny_model_dir, tmp_path / "recipe", targets=("q_proj", "v_proj"))
    want = load_adapter("plain", path, cfg, rename_language_model_key)
    _with_vision_modules(tiny_model_dir, path)
    assert json.loads((path / CONFIG).read_text())["target_modules"] == ["q_proj", "v_proj"]
    with caplog.at_level(logging.INFO, logger="mmserve.decoder.lora"):
        adapter = load_adapter("recipe", path, cfg, rename_language_model_key)
    assert adapter.weights.keys() == want.weights.keys()
    for key, (a, b) in want.weights.items():
        assert torch.equal(adapter.weights[key][0], a) and torch.equal(adapter.weights[key][1], b)
    assert adapter.left_out and all("vision_tower" in m for m in adapter.left_out)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "'recipe'" in lines[0] and "vision_tower" in lines[0] \
        and "layers.*.self_attn.q_proj" in lines[0], lines


def test_an_adapter_of_the_vision_tower_alone_is_refused(tiny_model_dir, cfg, tmp_path):
    path = _with_vision_modules(tiny_model_dir, write_adapter(tiny_model_dir, tmp_path / "v", ("q_proj",)),
                                only_vision=True)
    with pytest.raises(LoRAError, match="no LoRA weights for the language model .*vision_tower"):
        load_adapter("v", path, cfg, rename_language_model_key)


def test_decoder_start_up_refuses_a_non_lora_adapter_without_a_traceback(tiny_model_dir, tmp_path):
    from tests.cli_errors import assert_usage_error, run_cli

    path = _edit(write_adapter(tiny_model_dir, tmp_path / "ia3", targets=("q_proj",)), {"peft_type": "IA3"})
    result = run_cli("decoder", "--encoder", "127.0.0.1:1", "--model", str(tiny_model_dir), "--port", "0",
                     "--lora-modules", f"ia3={path}", timeout=120)
    assert_usage_error(result, "LoRA adapter 'ia3'", CONFIG, "`peft_type` 'IA3' is not LoRA")
