"""The Qwen3-VL presets: qwen3-vl-tiny makes varied HF greedy output; qwen3-vl-8b has the real shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from common.families.qwen3_vl.maker import QWEN3_PRESETS, QWEN3_VL_IMAGE_PROCESSOR, build_qwen3_config
from common.model_maker import preset_names

N = 12
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture?<|im_end|>\n"
       "<|im_start|>assistant\n")


def test_registered_with_make_model():
    assert {"qwen3-vl-tiny", "qwen3-vl-8b"} <= set(preset_names())


def test_outputs_vary(qwen3_oracle, qwen_images):
    """The preset's weights are scaled so that greedy output is not one repeated token."""
    assert len(set(qwen3_oracle.generate(ONE, qwen_images[:1], N))) > N // 2


def test_tiny_is_dense_with_deepstack(qwen3_oracle):
    config = qwen3_oracle.model.config
    assert config.model_type == "qwen3_vl"  # not qwen3_vl_moe
    assert list(config.vision_config.deepstack_visual_indexes) == [0, 1, 2]
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size


def test_chat_template(qwen3_oracle):
    """Qwen3-VL's template: no default system turn (Qwen2.5-VL's has one); images as vision tokens."""
    tokenizer = qwen3_oracle.tokenizer

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    content = [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]
    user = {"role": "user", "content": content}
    assert render([user]) == ONE
    assert render([{"role": "system", "content": "be brief"}, user]) == (
        "<|im_start|>system\nbe brief<|im_end|>\n" + ONE)


def test_preprocessor_config(qwen3_model_dir):
    data = json.loads((qwen3_model_dir / "preprocessor_config.json").read_text())
    assert data["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    assert (data["patch_size"], data["merge_size"], data["temporal_patch_size"]) == (16, 2, 2)
    assert data["image_mean"] == data["image_std"] == [0.5, 0.5, 0.5]
    assert data["image_std"] == QWEN3_VL_IMAGE_PROCESSOR["image_std"]


def test_8b_shapes():
    """Qwen/Qwen3-VL-8B-Instruct's config.json fields (cited in common/families/qwen3_vl/maker.py), built
    on the meta device: no weights are made."""
    from transformers import Qwen3VLForConditionalGeneration

    ids = {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
           "<|video_pad|>": 151656, "<|endoftext|>": 151643}
    tokenizer = SimpleNamespace(convert_tokens_to_ids=ids.__getitem__, eos_token_id=151645,
                                pad_token_id=151643)
    config = build_qwen3_config(QWEN3_PRESETS["qwen3-vl-8b"], tokenizer)
    vision, text = config.vision_config, config.text_config
    assert (vision.depth, vision.hidden_size, vision.intermediate_size) == (27, 1152, 4304)
    assert vision.num_heads == 16
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (16, 2, 2)
    assert (vision.num_position_embeddings, list(vision.deepstack_visual_indexes)) == (2304, [8, 16, 24])
    assert (vision.hidden_act, vision.out_hidden_size) == ("gelu_pytorch_tanh", 4096)
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (4096, 12288, 36)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (32, 8, 128)
    assert text.vocab_size == 151936
    rope = text.rope_parameters
    assert (rope["rope_theta"], list(rope["mrope_section"])) == (5e6, [24, 20, 20])
    assert rope["mrope_interleaved"] is True
    assert (config.image_token_id, config.vision_start_token_id) == (151655, 151652)
    assert config.tie_word_embeddings is False
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    # What these shapes add up to: the 8.77B parameters Qwen3-VL-8B-Instruct is published with.
    assert sum(p.numel() for p in model.parameters()) == 8_767_123_696
