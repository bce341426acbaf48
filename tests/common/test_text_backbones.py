"""The text side of the family seam: each family declares its text backbones and weight prefixes in its
folder's text.py (common/families/text.py), and the decoder's config parsing and loader ask the registry.
A family whose language model is a known backbone is its folder plus one registry line."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.checkpoint import CheckpointError
from common.families import FAMILIES, registry
from common.families.qwen2_5_vl.text import QWEN2
from common.families.text import TextBackbone, TextSpec
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import _checkpoint_state, rename_language_model_key

SHAPE = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, sliding_window=16, use_sliding_window=False)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_declares_its_text_in_its_folder(family):
    spec = family.text_spec()
    assert isinstance(spec, TextSpec) and spec.backbones and spec.weight_prefixes
    assert family.text == f"common.families.{family.name}.text:TEXT"
    assert all(isinstance(b, TextBackbone) for b in spec.backbones)


def test_a_text_model_type_names_one_backbone():
    types = registry.supported_text_model_types()
    assert len(types) == len(set(types)), "two backbones read one text model_type"
    assert all(registry.text_backbone(t).model_types.count(t) == 1 for t in types)
    assert registry.text_backbone("gemma") is None  # Gemma 1: no family serves it


def test_weight_prefixes_are_one_map_most_specific_first():
    prefixes = registry.language_weight_prefixes()
    lengths = [len(src) for src, _ in prefixes]
    assert lengths == sorted(lengths, reverse=True) and len({s for s, _ in prefixes}) == len(prefixes)
    conflicting = replace(FAMILIES[0], name="clash", text=f"{__name__}:CLASH")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "FAMILIES", (*FAMILIES, conflicting))
        with pytest.raises(ValueError, match="'lm_head.' is mapped to both"):
            registry.language_weight_prefixes()


CLASH = TextSpec(backbones=(QWEN2,), weight_prefixes=(("lm_head.", "head."),))

# A new family whose language model is Qwen3's layers under a text model_type of its own, and whose
# checkpoints may also carry a Qwen2 language model; its weights sit under a prefix no family uses yet.
# The image side reuses Qwen3-VL's declarations: only the text side is under test.
TOY_INIT = '''
from dataclasses import replace

from common.families.qwen3_vl import FAMILY as QWEN3_VL

FAMILY = replace(QWEN3_VL, name="toyvl", model_types=("toyvl",), text="toyvl.text:TEXT")
'''
TOY_TEXT = '''
from dataclasses import replace

from common.families.qwen2_5_vl.text import QWEN2
from common.families.qwen3_vl.text import QWEN3
from common.families.text import TextSpec

TOY = replace(QWEN3, name="toy", model_types=("toyvl_text",))
TEXT = TextSpec(backbones=(TOY, QWEN2), weight_prefixes=(("model.toy_lm.", ""), ("lm_head.", "lm_head.")))
'''


@pytest.fixture
def toy_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The throwaway family's folder, importable, and a function adding its one registry line."""
    folder = tmp_path / "toyvl"
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(TOY_INIT))
    (folder / "text.py").write_text(textwrap.dedent(TOY_TEXT))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda family: monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, family))
    for name in ("toyvl", "toyvl.text"):
        sys.modules.pop(name, None)


def test_a_family_with_a_known_backbone_is_its_folder_and_one_registry_line(toy_family, tmp_path):
    toy_cfg = {**SHAPE, "model_type": "toyvl_text"}
    with pytest.raises(CheckpointError, match="unsupported language model 'toyvl_text'"):
        TextModelConfig.from_hf(toy_cfg)
    assert rename_language_model_key("model.toy_lm.layers.0.mlp.up_proj.weight") is None

    import toyvl

    toy_family(toyvl.FAMILY)
    assert registry.find_family({"model_type": "toyvl"}) is toyvl.FAMILY
    toy = TextModelConfig.from_hf(toy_cfg)
    # Qwen3's reading, field for field: qk-norm, no biases, the unused window dropped.
    assert toy == replace(TextModelConfig.from_hf({**SHAPE, "model_type": "qwen3_vl_text"}),
                          model_type="toyvl_text")
    assert toy.qk_norm and not toy.qkv_bias and toy.sliding_window is None
    assert TextModelConfig.from_hf({**SHAPE, "model_type": "qwen2"}).qkv_bias  # shared, still Qwen2's
    key = "model.toy_lm.layers.0.mlp.up_proj.weight"
    assert rename_language_model_key(key) == "layers.0.mlp.up_proj.weight"

    # The loader reads its language model's tensors by its prefixes, and nothing else.
    from safetensors.torch import save_file

    save_file({"model.toy_lm.layers.0.mlp.up_proj.weight": torch.ones(2, 2),
               "model.toy_lm.norm.weight": torch.ones(2), "lm_head.weight": torch.ones(3, 2),
               "model.visual.blocks.0.weight": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    state = _checkpoint_state(tmp_path, toy)
    assert sorted(state) == ["layers.0.mlp.up_proj.weight", "lm_head.weight", "norm.weight"]


def test_backbone_switches_are_read_as_declared(monkeypatch: pytest.MonkeyPatch):
    """Each TextBackbone field reaches TextModelConfig (through a backbone the registry does not hold)."""
    custom = TextBackbone(name="custom", model_types=("custom_text",), qkv_bias=True, o_bias=True,
                          partial_rotary=True, window_switch=None, read_fields=lambda cfg, rope: (
                              rope, {"sandwich_norms": True, "hidden_act": cfg["act"]}),
                          activations=("silu", "gelu_pytorch_tanh"))
    monkeypatch.setattr("decoder_svc.model.config.text_backbone", {"custom_text": custom}.get)
    cfg = TextModelConfig.from_hf({**SHAPE, "model_type": "custom_text", "partial_rotary_factor": 0.5,
                                   "act": "gelu_pytorch_tanh"})
    assert cfg.qkv_bias and cfg.o_bias and cfg.rotary_dim == 8 and cfg.sliding_window == 16
    assert cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh" and not cfg.qk_norm
    with pytest.raises(CheckpointError, match="unsupported hidden_act 'relu'"):
        TextModelConfig.from_hf({**SHAPE, "model_type": "custom_text", "act": "relu"})
