"""Gemma 3's layout against HF's Gemma3Processor: token counts and the expanded prompt's ids."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from common.checkpoint import load_config
from common.families.gemma3 import FAMILY
from common.families.gemma3.layout import (
    PAN_AND_SCAN_DEFAULTS,
    Gemma3ImageLayout,
    PanAndScan,
    UnsupportedGemmaConfigError,
    gemma3_layout,
)
from common.hashing import hash_image_file
from common.image_geometry import hash_fingerprint
from tests.gemma3.conftest import sample_images


def _layout(model_dir: Path) -> Gemma3ImageLayout:
    return FAMILY.image_layout(model_dir, load_config(model_dir))


def test_count_from_config(gemma3_tiny_dir: Path) -> None:
    layout = _layout(gemma3_tiny_dir)
    tokens = load_config(gemma3_tiny_dir)["mm_tokens_per_image"]
    assert layout.tokens_per_image == layout.num_tokens() == tokens
    assert not layout.sized_by_image and not layout.mrope and not layout.takes_video
    assert layout.positions(10, []) is None


@pytest.mark.parametrize("n_images", [1, 2])
def test_expanded_ids_equal_hf(gemma3_tiny_dir: Path, n_images: int) -> None:
    from transformers import AutoProcessor

    layout = _layout(gemma3_tiny_dir)
    text = FAMILY.layout_class().load_text_processor(gemma3_tiny_dir)
    hf = AutoProcessor.from_pretrained(str(gemma3_tiny_dir), local_files_only=True)
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "what is in the picture?"}]
    prompt = text.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    assert prompt.count(text.image_token) == n_images
    images = sample_images()[:n_images]
    want = hf(text=prompt, images=images, return_tensors="pt")
    ours = text.tokenizer(layout.expand_prompt(prompt, n_images))["input_ids"]
    assert ours == want["input_ids"][0].tolist()
    image_id = load_config(gemma3_tiny_dir)["image_token_index"]
    assert ours.count(image_id) == n_images * layout.tokens_per_image
    assert int(want["token_type_ids"].sum()) == n_images * layout.tokens_per_image
    assert hf.full_image_sequence == layout.image_block()


def test_marker_count_must_match(gemma3_tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="1 <start_of_image> markers but 2 images"):
        _layout(gemma3_tiny_dir).expand_prompt("a <start_of_image> b", 2)


def _config(**over) -> dict:
    config = {"model_type": "gemma3", "mm_tokens_per_image": 256,
              "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14}}
    config.update(over)
    return config


IMAGE_PROCESSOR = {"size": {"height": 896, "width": 896}, "do_resize": True}


def test_real_shapes() -> None:
    """gemma-3-4b-it's numbers: 64x64 patches pooled 4x4 to 256 tokens."""
    layout = gemma3_layout(_config(), {"image_seq_length": 256}, IMAGE_PROCESSOR)
    assert layout.tokens_per_image == 256


def test_pan_and_scan_served() -> None:
    """do_pan_and_scan makes counts follow each image (tests/gemma3/test_pan_and_scan.py checks them)."""
    layout = gemma3_layout(_config(), {}, {**IMAGE_PROCESSOR, "do_pan_and_scan": True})
    assert layout.pan_and_scan is not None and layout.sized_by_image and layout.tokens_per_image is None
    assert layout.num_tokens(layout.grid(896, 2000)) == 3 * 256  # two crops side by side


@pytest.mark.parametrize("tokens", [255, 49])  # not square; 7 does not divide 64
def test_uneven_pooling_refused(tokens: int) -> None:
    with pytest.raises(UnsupportedGemmaConfigError, match="does not pool"):
        gemma3_layout(_config(mm_tokens_per_image=tokens), {}, IMAGE_PROCESSOR)


def test_processor_count_must_match() -> None:
    with pytest.raises(UnsupportedGemmaConfigError, match="expands each image to 64"):
        gemma3_layout(_config(), {"image_seq_length": 64}, IMAGE_PROCESSOR)


def test_processor_size_must_match() -> None:
    with pytest.raises(UnsupportedGemmaConfigError, match="vision tower takes 896x896"):
        gemma3_layout(_config(), {}, {"size": {"height": 448, "width": 448}})


def test_every_crop_setting_changes_the_image_hash() -> None:
    """Cache correctness: two crop rules cut the same bytes into different pixels, so their images never
    share a content hash (each setting the config gives, crops on by the checkpoint or by a request)."""
    assert set(PAN_AND_SCAN_DEFAULTS) == {f"pan_and_scan_{f.name}" for f in fields(PanAndScan)}
    data = b"the same image file"
    for crops_on in (True, False):
        processor = {**IMAGE_PROCESSOR, "do_pan_and_scan": crops_on}
        plain = gemma3_layout(_config(), {}, processor)
        hashes = {hash_image_file(data, hash_fingerprint("fp", plain.crops(True)))}
        for name, default in PAN_AND_SCAN_DEFAULTS.items():
            other = gemma3_layout(_config(), {}, {**processor, name: default * 2})
            key = hash_image_file(data, hash_fingerprint("fp", other.crops(True)))
            assert key not in hashes, name
            hashes.add(key)
            # without crops the rule changes nothing: the plain image's hash
            assert hash_fingerprint("fp", other.crops(False)) == hash_fingerprint("fp", plain.crops(False))
