"""Image-token counts from the configs equal what HF's LlavaProcessor puts in the prompt, and configurations
that cannot be served are refused with the reason."""

from __future__ import annotations

import json

import pytest

from common.families.llava.layout import (
    UnsupportedImageConfigError,
    image_token_layout,
    load_image_token_layout,
    processed_pixel_size,
    read_processor_configs,
)
from tests.oracle import make_image

CLIP = {"model_type": "clip_vision_model", "image_size": 28, "patch_size": 7, "num_hidden_layers": 2}
SIGLIP = {"model_type": "siglip_vision_model", "image_size": 30, "patch_size": 7, "num_hidden_layers": 3}
CLIP_PROC = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 28},
             "crop_size": {"height": 28, "width": 28}, "do_center_crop": True}
SIGLIP_PROC = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 30, "width": 30}}

# (vision config, image processor, strategy, num_additional_image_tokens, feature layer, expected tokens)
CASES = {
    "clip-default": (CLIP, CLIP_PROC, "default", 1, -2, 16),
    "clip-full": (CLIP, CLIP_PROC, "full", 1, -2, 17),
    "clip-layer-list": (CLIP, CLIP_PROC, "default", 1, [0, -1], 16),
    "clip-legacy-int-crop": (CLIP, {"image_processor_type": "CLIPImageProcessor", "size": 28,
                                    "crop_size": 28}, "default", 1, -2, 16),
    # 30 // 7 = 4 patches a side (like SigLIP-384/14: 27): no CLS row, so "full" keeps every patch.
    "siglip-full": (SIGLIP, SIGLIP_PROC, "full", 0, -1, 16),
    "siglip-default": (SIGLIP, SIGLIP_PROC, "default", 0, -1, 15),  # HF drops the first patch row
}


def _config(vision: dict, strategy: str, layer) -> dict:
    return {"model_type": "llava", "vision_config": vision, "vision_feature_select_strategy": strategy,
            "vision_feature_layer": layer}


def _hf_count(tokenizer, image_processor: dict, patch: int, strategy: str, additional: int) -> int:
    from transformers import CLIPImageProcessor, LlavaProcessor, SiglipImageProcessor

    kind = SiglipImageProcessor if "Siglip" in image_processor["image_processor_type"] else CLIPImageProcessor
    args = {k: v for k, v in image_processor.items() if k != "image_processor_type"}
    processor = LlavaProcessor(image_processor=kind(**args), tokenizer=tokenizer, patch_size=patch,
                               vision_feature_select_strategy=strategy,
                               num_additional_image_tokens=additional)
    ids = processor(text="a <image> b", images=[make_image(5, (41, 23))])["input_ids"][0]
    return sum(1 for t in ids if t == processor.image_token_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("name", list(CASES))
def test_count_equals_hf_processor(name, tokenizer):
    vision, image_processor, strategy, additional, layer, expected = CASES[name]
    processor = {"patch_size": vision["patch_size"], "vision_feature_select_strategy": strategy,
                 "num_additional_image_tokens": additional}
    layout = image_token_layout(_config(vision, strategy, layer), processor, image_processor)
    assert layout.num_image_tokens == expected
    assert _hf_count(tokenizer, image_processor, vision["patch_size"], strategy, additional) == expected
    assert layout.has_cls == (vision["model_type"] == "clip_vision_model")


def test_missing_processor_fields_come_from_the_vision_config():
    # An older checkpoint whose processor_config.json names none of them: the model's own count.
    assert image_token_layout(_config(CLIP, "default", -2), {}, CLIP_PROC).num_image_tokens == 16
    assert image_token_layout(_config(SIGLIP, "full", -1), {}, SIGLIP_PROC).num_image_tokens == 16


@pytest.mark.parametrize("vision, image_processor, processor, strategy, match", [
    (CLIP, {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 28},
            "do_center_crop": False}, {}, "default", "depend on the image"),
    (CLIP, {**CLIP_PROC, "do_resize": False, "do_center_crop": False}, {}, "default", "fixed size"),
    (CLIP, {"image_processor_type": "CLIPImageProcessor", "size": 28}, {}, "default", "aspect ratio"),
    # transformers reads an int size as a shortest edge for SigLIP too (a 41x23 image gets 28 tokens)
    (SIGLIP, {"image_processor_type": "SiglipImageProcessor", "size": 30}, {}, "full", "aspect ratio"),
    (CLIP, CLIP_PROC, {"vision_feature_select_strategy": "full"}, "default",
     "processor's vision_feature_select_strategy is 'full' but the model's is 'default'"),
    (CLIP, CLIP_PROC, {"num_additional_image_tokens": 0}, "default",
     "expand each image to 15 tokens .* gives 16 feature rows"),
    (SIGLIP, SIGLIP_PROC, {"num_additional_image_tokens": 1}, "full", r"17 tokens .* \(without a CLS row"),
    (CLIP, CLIP_PROC, {"patch_size": 14}, "default", "patch_size is 14 but the vision tower's is 7"),
    (CLIP, {**CLIP_PROC, "crop_size": {"height": 56, "width": 56}}, {}, "default",
     "outputs 56x56 pixels but the vision tower takes 28x28"),
    ({**CLIP, "model_type": "pixtral"}, CLIP_PROC, {}, "default", "vision tower 'pixtral' is not supported"),
    (CLIP, CLIP_PROC, {}, "spatial_unpad", "vision_feature_select_strategy 'spatial_unpad'"),
])
def test_unsupported_configurations_are_refused(vision, image_processor, processor, strategy, match):
    with pytest.raises(UnsupportedImageConfigError, match=match):
        image_token_layout(_config(vision, strategy, -1), processor, image_processor)


def test_other_llava_families_are_refused():
    config = {**_config(CLIP, "default", -2), "model_type": "llava_next"}
    with pytest.raises(UnsupportedImageConfigError, match="model_type 'llava_next' is not supported"):
        image_token_layout(config, {}, CLIP_PROC)


def test_feature_layer_outside_the_tower():
    with pytest.raises(UnsupportedImageConfigError, match="vision_feature_layer 3 is outside"):
        image_token_layout(_config(CLIP, "default", [0, 3]), {}, CLIP_PROC)


def test_pixel_size_fields():
    assert processed_pixel_size({"size": {"height": 384, "width": 384}}) == (384, 384)
    assert processed_pixel_size({"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                                 "do_center_crop": True}) == (336, 336)


def test_both_processor_file_layouts(tiny_model_dir, tmp_path):
    nested = load_image_token_layout(tiny_model_dir)  # transformers 5: processor_config.json holds both
    processor = json.loads((tiny_model_dir / "processor_config.json").read_text())
    image_processor = processor.pop("image_processor")
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps(processor))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image_processor))  # llava-hf layout
    assert read_processor_configs(tmp_path) == (processor, image_processor)
    assert load_image_token_layout(tmp_path) == nested
    assert nested.num_image_tokens == 16
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(UnsupportedImageConfigError, match="no image processor config"):
        load_image_token_layout(tmp_path)
