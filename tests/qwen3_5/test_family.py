"""The Qwen3.5 folder: served, its references resolve, its presets' shapes, its layout
(Qwen3-VL's), and its vision encoder equal to HF's get_image_features in fp32."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import CheckpointError, load_config
from common.families import FAMILIES, family_by_name
from common.families.family import load_attr
from common.families.qwen3_5 import FAMILY
from common.families.registry import NOT_SERVED_YET, find_family


def test_served():
    assert FAMILY.name not in NOT_SERVED_YET and FAMILY in FAMILIES
    assert find_family({"model_type": "qwen3_5"}) is FAMILY and family_by_name("qwen3_5") is FAMILY


def test_every_reference_resolves():
    import transformers

    for ref in (FAMILY.vision_encoder, FAMILY.maker, FAMILY.layout, FAMILY.oracle):
        assert callable(load_attr(ref)) and ref.startswith("common.families.qwen3_5.")
    assert getattr(transformers, FAMILY.hf_class)
    assert FAMILY.preset_names() == ["qwen3.5-tiny", "qwen3.5-9b"]
    assert FAMILY.text_spec().backbones[0].model_types == ("qwen3_5_text", "qwen3_5")


def test_9b_shapes():
    from common.families.qwen3_5.maker import QWEN3_5_PRESETS, build_qwen3_5_config
    from common.families.qwen3_vl.maker import build_qwen3_tokenizer

    config = build_qwen3_5_config(QWEN3_5_PRESETS["qwen3.5-9b"], build_qwen3_tokenizer(512))
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.linear_num_key_heads, text.linear_num_value_heads,
            text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim) == (
        4096, 32, 16, 32, 128, 128, 4)
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + text.layer_types[4:]
    assert text.layer_types.count("full_attention") == 8 and text.layer_types[3::4] == ["full_attention"] * 8
    assert (vision.hidden_size, vision.depth, vision.out_hidden_size) == (1152, 27, 4096)


def test_tiny_is_hybrid_and_its_greedy_output_varies(qwen3_5_oracle, qwen_images):
    from common.families.qwen3_5.oracle import IMAGE_PAD

    text = qwen3_5_oracle.model.config.text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text.linear_num_value_heads > text.linear_num_key_heads  # grouped value heads, as the 9B's
    prompt = f"<|im_start|>user\n<|vision_start|>{IMAGE_PAD}<|vision_end|>what is it?<|im_end|>\n"
    tokens = [qwen3_5_oracle.generate(prompt, [image], 12) for image in qwen_images[:2]]
    assert all(len(set(t)) >= 6 for t in tokens)  # not one token repeated
    assert tokens[0] != tokens[1]  # the image changes the answer


def test_layout_is_qwen3_vl_s(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    """Token counts and M-RoPE positions of a prompt with an image equal HF's get_rope_index."""
    from common.families.qwen3_5.oracle import IMAGE_PAD

    config = load_config(qwen3_5_model_dir)
    layout = FAMILY.image_layout(qwen3_5_model_dir, config)
    with pytest.raises(CheckpointError, match="not a Qwen3.5 checkpoint"):
        FAMILY.image_layout(qwen3_5_model_dir, {**config, "model_type": "qwen3_vl"})
    assert layout.mrope and layout.takes_video and layout.patch_size == 16
    image = qwen_images[1]
    inputs = qwen3_5_oracle.inputs(f"a<|vision_start|>{IMAGE_PAD}<|vision_end|>b c", [image])
    grid = layout.grid(image.height, image.width, layout.pixel_range())
    assert list(inputs["image_grid_thw"][0]) == list(grid)
    ids = inputs["input_ids"][0]
    offset = int((ids == layout.image_token_id).nonzero()[0])
    assert int((ids == layout.image_token_id).sum()) == layout.num_tokens(grid)
    ours, delta = layout.positions(len(ids), [(offset, grid)])
    with torch.no_grad():
        ref, ref_delta = qwen3_5_oracle.model.model.get_rope_index(
            input_ids=inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"], mm_token_type_ids=inputs["mm_token_type_ids"])
    assert ours.tolist() == ref[:, 0].tolist() and delta == int(ref_delta[0])
    assert layout.video_config(qwen3_5_model_dir) is not None


def test_encoder_equals_hf_image_features(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    encoder = FAMILY.make_vision_encoder(qwen3_5_model_dir)
    assert encoder.preprocess_mode == "hf" and encoder.parts == 1
    assert not encoder.tower.deepstack_indexes
    ours = encoder.encode(qwen_images)
    refs = qwen3_5_oracle.image_features(*qwen3_5_oracle.pixels(qwen_images))
    for image, mine, ref in zip(qwen_images, ours, refs, strict=True):
        grid = encoder.layout.grid(image.height, image.width, encoder.default_pixels)
        assert mine.shape == (encoder.layout.num_tokens(grid), 64) == ref.shape
        assert torch.equal(mine, ref)  # bit-equal in fp32
        assert encoder.nbytes_for(grid) == mine.numel() * mine.element_size()


def test_encoder_refuses_another_model_type(qwen3_5_model_dir, tmp_path):
    import json
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(qwen3_5_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl"}))
    with pytest.raises(CheckpointError, match="not a Qwen3.5 checkpoint"):
        FAMILY.make_vision_encoder(out)
