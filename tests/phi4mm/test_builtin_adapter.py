"""The checkpoint's own vision LoRA read as a built-in adapter (decoder_svc/model/lora/builtin.py): from
its tensors and config.json's `vision_lora` (scaling lora_alpha / r folded into B), the speech adapter
left unread, a `vision-lora/` PEFT directory read instead where there is one, random at the config's rank
under `--load-format dummy`, refused with the reason when missing or clashing with a --lora-modules name;
and sharded over two ranks (CPU, gloo) with the tokens of one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.images import encode_png
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.model import TextModelConfig, load_language_model
from decoder_svc.model.loader import rename_language_model_key, text_config_dict
from decoder_svc.model.lora import LoRAError, LoRALinear
from decoder_svc.model.lora.builtin import builtin_adapter_names, load_builtin_adapter
from tests.oracle import greedy, run_all
from tests.phi4mm.images import sample_images
from tests.phi4mm.test_vision_lora import ONE, TEXT


@pytest.fixture(scope="module")
def cfg(phi4_tiny_dir: Path) -> TextModelConfig:
    return TextModelConfig.from_hf(text_config_dict(phi4_tiny_dir))


def test_read_from_the_checkpoints_tensors(phi4_tiny_dir, cfg):
    assert builtin_adapter_names(phi4_tiny_dir) == ["vision"]
    adapter = load_builtin_adapter(phi4_tiny_dir, "vision", cfg, rename_key=rename_language_model_key)
    spec = json.loads((phi4_tiny_dir / "config.json").read_text())["vision_lora"]
    leaves = sorted(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert sorted(adapter.weights) == [(layer, leaf) for layer in range(cfg.num_layers) for leaf in leaves]
    tensors = load_file(str(phi4_tiny_dir / "model.safetensors"))
    a, b = adapter.weights[(1, "gate_up_proj")]
    prefix = "model.layers.1.mlp.gate_up_proj"
    assert torch.equal(a, tensors[f"{prefix}.lora_A.vision.weight"])
    scale = spec["lora_alpha"] / spec["r"]
    torch.testing.assert_close(b, tensors[f"{prefix}.lora_B.vision.weight"] * scale)
    assert not torch.equal(tensors[f"{prefix}.lora_A.speech.weight"][:4], a[:4])  # another adapter's


def test_a_peft_directory_beside_the_weights_is_read(phi4_tiny_dir, cfg, tmp_path):
    tensors = load_file(str(phi4_tiny_dir / "model.safetensors"))
    peft = {f"base_model.model.{k.replace('.vision.', '.')}": v
            for k, v in tensors.items() if ".vision." in k}
    model = tmp_path / "m"
    shutil.copytree(phi4_tiny_dir, model)
    (model / "vision-lora").mkdir()
    save_file(peft, str(model / "vision-lora/adapter_model.safetensors"))
    (model / "vision-lora/adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}))
    ours = load_builtin_adapter(model, "vision", cfg, rename_key=rename_language_model_key)
    theirs = load_builtin_adapter(phi4_tiny_dir, "vision", cfg, rename_key=rename_language_model_key)
    assert ours.path == model / "vision-lora" and sorted(ours.weights) == sorted(theirs.weights)
    for key, (a, b) in theirs.weights.items():
        assert torch.equal(ours.weights[key][0], a) and torch.equal(ours.weights[key][1], b)


def test_dummy_weights_get_a_dummy_adapter(phi4_tiny_dir):
    model = load_language_model(phi4_tiny_dir, "cpu", torch.float32, "torch", load_format="dummy")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoRALinear) and qkv.rank == 8 and qkv.lora_b.abs().sum() > 0


def test_refusals(phi4_tiny_dir, cfg, tmp_path):
    model = tmp_path / "no-lora"
    shutil.copytree(phi4_tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    del config["vision_lora"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="no `vision_lora`"):
        load_builtin_adapter(model, "vision", cfg, rename_key=rename_language_model_key)
    with pytest.raises(LoRAError, match="checkpoint's own adapters"):
        load_language_model(phi4_tiny_dir, "cpu", torch.float32, "torch", lora_modules={"vision": "x"})


def test_a_bad_alpha_or_a_non_finite_weight_is_refused_in_one_line(phi4_tiny_dir, cfg, tmp_path):
    model = tmp_path / "bad"
    shutil.copytree(phi4_tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    for alpha in ("16", None, [16]):
        (model / "config.json").write_text(json.dumps({**config, "vision_lora": {**config["vision_lora"],
                                                                                  "lora_alpha": alpha}}))
        with pytest.raises(LoRAError, match=r"config.json `vision_lora`: `lora_alpha` must be a finite"):
            load_builtin_adapter(model, "vision", cfg, dummy=True, rename_key=rename_language_model_key)
    (model / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(model / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.lora_B.vision.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][2, 0] = float("nan")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoRAError, match=r"layers.1.mlp.down_proj.lora_B.vision .*holds NaN or Inf") as err:
        load_builtin_adapter(model, "vision", cfg, rename_key=rename_language_model_key)
    assert "\n" not in str(err.value)


def test_two_ranks_give_one_ranks_tokens(phi4_tiny_dir):
    files = [encode_png(sample_images()[i]) for i in ONE[1]]
    outs = []
    for tp in (1, 2):
        config = EngineConfig(model=phi4_tiny_dir, num_kv_blocks=128, max_num_batched_tokens=100,
                              tensor_parallel_size=tp)
        engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
        try:
            engine.add_request("i", ONE[0], files, sampling=greedy(8))
            engine.add_request("t", TEXT[0], sampling=greedy(8))
            outs.append({rid: r["tokens"] for rid, r in run_all(engine).items()})
        finally:
            engine.close()
    assert outs[0] == outs[1] and len(outs[0]["i"]) == 8
