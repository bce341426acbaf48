"""pixels.py and the layout against Hugging Face's own Phi4MultimodalProcessor: HF's processor code runs in
a subprocess with tv_shim.py's torchvision stand-in (resize, pad, normalize: the same torch kernels), so
its crop choice, padding, masks, token counts, global view, batching and prompt expansion are HF's, while
only torchvision's three kernels are the shim's (bench/phi4mm_pixels_check.py compares with the real
torchvision where it is installed)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.checkpoint import load_config
from common.families.phi4mm.layout import Phi4ImageLayout
from common.families.phi4mm.pixels import batch_pixels, hd_transform, num_tokens
from common.image_geometry import ImageGeometryError
from common.images import encode_png
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams
from tests.phi4mm.images import SIZES, sample_images
from tests.phi4mm.tv_shim import write_shim

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_outputs(phi4_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = write_shim(tmp_path_factory.mktemp("tv_shim"))
    out = root / "hf.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))
    subprocess.run([sys.executable, "-m", "tests.phi4mm.hf_processor_run", str(phi4_tiny_dir), str(out)],
                   cwd=ROOT, env=env, check=True, timeout=300)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def layout(phi4_tiny_dir: Path) -> Phi4ImageLayout:
    return Phi4ImageLayout.from_checkpoint(phi4_tiny_dir, load_config(phi4_tiny_dir))


def test_each_image_has_hf_crops_masks_sizes_and_tokens(hf_outputs, layout):
    images = sample_images()
    assert len(hf_outputs["single"]) == len(images)
    for image, hf in zip(images, hf_outputs["single"], strict=True):
        ours = batch_pixels([hd_transform(image, layout.settings)])
        assert ours["image_pixel_values"].shape == hf["image_pixel_values"].shape, image.size
        assert torch.equal(ours["image_pixel_values"], hf["image_pixel_values"]), image.size
        assert torch.equal(ours["image_attention_mask"], hf["image_attention_mask"]), image.size
        assert torch.equal(ours["image_sizes"], hf["image_sizes"]), image.size


def test_token_counts_from_the_header_equal_hf(hf_outputs, layout):
    images = sample_images()
    counts = [int(c) for c in hf_outputs["num_img_tokens"]]
    assert [num_tokens(*im.size, dynamic_hd=layout.settings.dynamic_hd) for im in images] == counts
    assert [layout.tokens_for_size(*im.size) for im in images] == counts
    assert len(set(counts)) >= len(SIZES) - 1  # the sizes really differ in tokens


def test_prompt_expansion_equals_hf(hf_outputs, layout, phi4_tiny_dir):
    tokenizer = layout.load_text_processor(phi4_tiny_dir).tokenizer
    for image, hf in zip(sample_images(), hf_outputs["single"], strict=True):
        text = layout.expand_prompt(hf["prompt"], [layout.tokens_for_size(*image.size)])
        assert tokenizer(text)["input_ids"] == hf["input_ids"][0].tolist()


def test_a_batch_of_images_equals_hf(hf_outputs, layout, phi4_tiny_dir):
    hf = hf_outputs["batch"]
    images = sample_images()[:3]
    ours = batch_pixels([hd_transform(im, layout.settings) for im in images])
    for key in ("image_pixel_values", "image_attention_mask", "image_sizes"):
        assert torch.equal(ours[key], hf[key]), key
    tokenizer = layout.load_text_processor(phi4_tiny_dir).tokenizer
    ids = tokenizer(layout.expand_prompt(hf["prompt"], ours["num_img_tokens"]))["input_ids"]
    assert ids == hf["input_ids"][0].tolist()


def test_too_thin_images_are_refused_as_hf_refuses_them(hf_outputs, layout):
    assert "aspect ratio is very extreme" in hf_outputs["extreme"]
    with pytest.raises(ImageGeometryError, match="too extreme"):
        layout.tokens_for_size(5000, 8)
    assert layout.tokens_for_size(5000, 20) > 0  # 21 px high once resized: HF takes it too


@pytest.fixture(scope="module")
def inputs(phi4_tiny_dir: Path):
    """The decoder's input processor on the tiny checkpoint."""
    from decoder_svc.engine.config import EngineConfig
    from decoder_svc.engine.input_processor import InputProcessor

    config = EngineConfig(model=phi4_tiny_dir, num_kv_blocks=8)
    return InputProcessor.for_model(config, kv_capacity_tokens=1 << 16)


def test_the_decoders_requests_from_image_files_have_hfs_input_ids(hf_outputs, inputs):
    """Headers alone (PNG bytes: nothing decoded) to token counts, expansion and ids, image by image."""
    for i, (image, hf) in enumerate(zip(sample_images(), hf_outputs["single"], strict=True)):
        # one new token: the 4000x900 image's 4014 tokens come close to the 4096 served (LongRoPE's short
        # factors only); the 1500x1500 one's 4433 pass it and are refused before any work
        make = functools.partial(inputs.make_request, f"r{i}", hf["prompt"], [encode_png(image)],
                                 sampling=SamplingParams(max_tokens=1))
        if hf["input_ids"].shape[1] >= inputs.model_config.max_model_len:
            with pytest.raises(InvalidRequestError, match="context length"):
                make()
            continue
        req = make()
        assert req.prompt_token_ids == hf["input_ids"][0].tolist(), image.size
        (ph,) = req.images
        assert ph.length == int(hf_outputs["num_img_tokens"][i])
        assert ph.grid == inputs.layout.grid(image.height, image.width)
        assert set(req.prompt_token_ids[ph.offset:ph.offset + ph.length]) == {inputs.tokenizer.image_token_id}


def test_the_chat_template_path_has_hfs_input_ids(hf_outputs, inputs):
    from tests.phi4mm.hf_processor_run import CHAT

    hf = hf_outputs["chat"]
    images = sample_images()[1:3]
    req = inputs.make_request("chat", messages=CHAT, images=[encode_png(im) for im in images])
    assert req.prompt_token_ids == hf["input_ids"][0].tolist()
    assert [p.length for p in req.images] == [int(n) for n in hf_outputs["num_img_tokens"][1:3]]
    assert hf["text"].startswith("<|system|>be brief<|end|><|user|><|image|>what is this")
