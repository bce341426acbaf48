"""Gemma 3 with pan-and-scan crops (the image processor config's do_pan_and_scan) against HF, fp32, CPU.

The crop count of every size equals HF's pan_and_scan; a cropped image's prompt text and ids equal
Gemma3Processor's; its embedding equals get_image_features over HF's pixel_values (the original, then the
crops); greedy generation through the engine equals HF's generate for square (no crops), wide and tall
images, at prefill budgets that would cut a block, and with a prefix-cache hit ending inside a crop.

The pan-and-scan checkpoint is gemma-3-tiny (same weights) with crops from 32 px (conftest.py), so the
sample images of a few hundred pixels crop; each block is 16 soft tokens.
"""

from __future__ import annotations

import io
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from common.checkpoint import load_config, model_fingerprint
from common.families.gemma3 import FAMILY
from common.families.gemma3.layout import (
    PAN_AND_SCAN_DEFAULTS,
    Gemma3ImageLayout,
    PanAndScan,
    UnsupportedGemmaConfigError,
    gemma3_layout,
)
from common.image_geometry import hash_fingerprint
from tests.gemma3.conftest import TINY_PAN_AND_SCAN, sample_images
from tests.gemma3.test_image_generate import TOP, assert_same, make_engine, step_sizes
from tests.oracle import greedy

N = 12
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def _layout(model_dir: Path) -> Gemma3ImageLayout:
    return FAMILY.image_layout(model_dir, load_config(model_dir))


def _hf_crops(pas: PanAndScan, height: int, width: int) -> int:
    """HF's own decision: Gemma3ImageProcessorPil.pan_and_scan on a blank channels-first image."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    crops = Gemma3ImageProcessorPil().pan_and_scan(
        np.zeros((3, height, width), dtype=np.uint8), pan_and_scan_min_crop_size=pas.min_crop_size,
        pan_and_scan_max_num_crops=pas.max_num_crops,
        pan_and_scan_min_ratio_to_activate=pas.min_ratio_to_activate)
    return len(crops)


SETTINGS = [PanAndScan(), TINY_PAN_AND_SCAN, PanAndScan(64, 3, 1.5), PanAndScan(100, 8, 1.0),
            PanAndScan(20, 1, 2.0)]
SIDES = [1, 2, 31, 32, 33, 50, 63, 64, 97, 100, 150, 199, 200, 224, 255, 256, 257, 300, 384, 511, 512,
         513, 640, 767, 768, 896, 1000, 1023, 1024, 1279, 1280, 2000]


@pytest.mark.parametrize("pas", SETTINGS, ids=lambda p: p.key())
def test_crop_counts_equal_hf(pas: PanAndScan) -> None:
    """Every (height, width) of a grid of sides, landscape, portrait and square, activating or not."""
    seen = set()
    for height in SIDES:
        for width in SIDES:
            want = _hf_crops(pas, height, width)
            assert pas.num_crops(height, width) == want, (pas, height, width)
            seen.add(want)
    assert 0 in seen and len(seen) >= 2  # both sides of the rule were compared


def test_crop_counts_of_the_processor(gemma3_pas_dir: Path, gemma3_pas_oracle) -> None:
    """The layout's grids from the checkpoint's config equal the crops HF's processor cuts the images
    into (num_crops), and the counts these tests rely on: square none, wide and tall two, the strip four."""
    layout = _layout(gemma3_pas_dir)
    assert layout.pan_and_scan == TINY_PAN_AND_SCAN and layout.sized_by_image
    assert layout.tokens_per_image is None and layout.largest_image_run == 16
    images = sample_images()
    want = gemma3_pas_oracle.num_crops(images)
    assert want == [2, 2, 0, 4]
    for image, n in zip(images, want, strict=True):
        grid = layout.grid(image.height, image.width)
        assert grid == (1 + n, 1, 1) and layout.check_grid(grid) == grid
        assert layout.num_tokens(grid) == (1 + n) * 16


@pytest.mark.parametrize("idx", [[0], [2], [1, 3], [3, 2, 0]])
def test_expanded_ids_equal_hf(gemma3_pas_dir: Path, gemma3_pas_oracle, idx: list[int]) -> None:
    """The marker's text (Gemma3Processor.replace_image_token's sentence and blocks) and the ids, through
    the layout and through the engine's tokenizer (each block one placeholder run of the image)."""
    from decoder_svc.tokenization import PromptTokenizer

    layout = _layout(gemma3_pas_dir)
    images = [sample_images()[i] for i in idx]
    prompt = TURN.format("look: " + " and ".join(["<start_of_image>"] * len(images)))
    want = gemma3_pas_oracle.inputs(prompt, images)
    crops = gemma3_pas_oracle.num_crops(images)
    text = layout.expand_prompt(prompt, len(images), crops)
    assert gemma3_pas_oracle.tokenizer(text)["input_ids"] == want["input_ids"][0].tolist()
    tokenizer = PromptTokenizer(gemma3_pas_dir)
    counts = [layout.num_tokens(layout.grid(im.height, im.width)) for im in images]
    ours = tokenizer.encode_prompt(prompt, [None] * len(images), image_token_counts=counts)
    assert ours.token_ids == want["input_ids"][0].tolist()
    assert [(p.image_index, p.length) for p in ours.placeholders] == [
        (i, 16) for i, n in enumerate(crops) for _ in range(1 + n)]
    assert int(want["token_type_ids"].sum()) == sum(counts)


def test_encoder_equals_hf_image_features(gemma3_pas_dir: Path, gemma3_pas_oracle) -> None:
    """Each image's rows: the original's, then its crops', as get_image_features over HF's pixel_values."""
    encoder = FAMILY.make_vision_encoder(gemma3_pas_dir)
    images = sample_images()
    ours = encoder.encode(images)
    want = gemma3_pas_oracle.image_features(gemma3_pas_oracle.pixels(images))
    crops = gemma3_pas_oracle.num_crops(images)
    assert want.shape[0] == sum(1 + n for n in crops)
    for got, ref in zip(ours, want.split([1 + n for n in crops]), strict=True):
        torch.testing.assert_close(got, ref.reshape(-1, ref.shape[-1]), atol=1e-5, rtol=1e-5)
    alone = encoder.encode([images[3]])[0]
    torch.testing.assert_close(alone, ours[3], atol=1e-5, rtol=1e-5)
    # the grid the encoder service keeps with the entry (Lookup answers it for hash-only requests)
    layout = _layout(gemma3_pas_dir)
    assert [encoder.prepare(im).grid for im in images] == [layout.grid(im.height, im.width) for im in images]
    encoder.warm_up()
    assert encoder.embedding_nbytes == 5 * 16 * 64 * 4  # the most crops: 4


def test_hash_follows_the_settings(gemma3_tiny_dir: Path, gemma3_pas_dir: Path,
                                   gemma3_pas_off_dir: Path) -> None:
    """Same config.json and weights, pan-and-scan only defaulting differently: the same model fingerprint
    (the crop rule, a processor setting, is the same), but an image's content hash (decoder and encoder
    alike) differs with pan-and-scan on, so a shared cache never mixes the two embeddings. Another crop
    rule is another fingerprint."""
    assert model_fingerprint(gemma3_pas_off_dir) == model_fingerprint(gemma3_pas_dir)
    assert model_fingerprint(gemma3_tiny_dir) != model_fingerprint(gemma3_pas_dir)
    # what the encoder service hashes an image under: its fingerprint with the image's crop choice
    plain, cropped = (hash_fingerprint(enc.fingerprint, enc.image_settings()) for enc in
                      (FAMILY.make_vision_encoder(d) for d in (gemma3_tiny_dir, gemma3_pas_dir)))
    assert plain != cropped and plain == model_fingerprint(gemma3_tiny_dir)
    assert cropped == model_fingerprint(gemma3_pas_dir) + "|" + TINY_PAN_AND_SCAN.key()
    buf = io.BytesIO()
    sample_images()[0].save(buf, format="PNG")
    requests = [make_engine(d).inputs.make_request("r", "<start_of_image>", [buf.getvalue()])
                for d in (gemma3_tiny_dir, gemma3_pas_dir)]
    hashes = [r.images[0].content_hash for r in requests]
    assert hashes[0] != hashes[1]


def test_settings_parsed_and_checked() -> None:
    config = {"model_type": "gemma3", "mm_tokens_per_image": 256,
              "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14}}
    base = {"size": {"height": 896, "width": 896}, "do_resize": True}
    assert gemma3_layout(config, {}, base).pan_and_scan is None
    # google/gemma-3-4b-it's config leaves the settings null: Gemma3Processor's defaults stand for them.
    nulls = {"pan_and_scan_min_crop_size": None, "pan_and_scan_max_num_crops": None}
    layout = gemma3_layout(config, {}, {**base, "do_pan_and_scan": True, **nulls})
    assert layout.pan_and_scan == PanAndScan(256, 4, 1.2)
    assert layout.marker_text("<start_of_image>", 2, 3).startswith("Here is the original image \n\n")
    with pytest.raises(UnsupportedGemmaConfigError, match="out of range"):
        gemma3_layout(config, {}, {**base, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0})


def test_every_crop_setting_changes_the_crop_choice_key() -> None:
    """Cache correctness: each setting of the crop rule, read from the image processor config, is in the
    key an image with crops on is hashed under (PAN_AND_SCAN_DEFAULTS names them all), so two checkpoints
    cutting by other rules never share an entry; the same rule gives the same key."""
    config = {"model_type": "gemma3", "mm_tokens_per_image": 256,
              "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14}}
    base = {"size": {"height": 896, "width": 896}, "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": 300, "pan_and_scan_max_num_crops": 3,
            "pan_and_scan_min_ratio_to_activate": 1.5}

    def key(image_processor: dict) -> str:
        return gemma3_layout(config, {}, image_processor).crops(True).key()

    assert key(base) == key(dict(base)) != ""
    assert set(PAN_AND_SCAN_DEFAULTS) == {"pan_and_scan_" + f.name for f in fields(PanAndScan)}
    keys = {key(base)}
    for name, value in base.items():
        if name.startswith("pan_and_scan_"):
            changed = key({**base, name: value + 1})
            assert changed not in keys, name
            keys.add(changed)


# -- generation through the engine -------------------------------------------------------------------
# images near the prompt's end (the tiny model's 16-token sliding window): square (no crops), wide and
# tall (2 crops each), the strip (4 crops), and two cropped images in one prompt
CASES = {"square": (TURN.format("what is it? <start_of_image>"), [2]),
         "wide": (TURN.format("describe <start_of_image>"), [0]),
         "tall": (TURN.format("<start_of_image>"), [1]),
         "strip": (TURN.format("a strip: <start_of_image>"), [3]),
         "two": (TURN.format("compare <start_of_image> with <start_of_image>"), [1, 0])}


def hf_first_logprobs(oracle, prompt: str, imgs: list) -> torch.Tensor:
    with torch.no_grad():
        return oracle.model(**oracle.inputs(prompt, imgs)).logits[0, -1].float().log_softmax(-1)


@pytest.fixture(scope="module")
def images():
    """One draw of the sample images (PIL's effect_noise is not seeded: HF and the engine see the same)."""
    return sample_images()


@pytest.fixture(scope="module")
def want(gemma3_pas_oracle, images) -> dict[str, tuple[list[int], torch.Tensor]]:
    return {name: (gemma3_pas_oracle.generate(prompt, [images[i] for i in idx], N),
                   hf_first_logprobs(gemma3_pas_oracle, prompt, [images[i] for i in idx]))
            for name, (prompt, idx) in CASES.items()}


def test_crops_change_hfs_output(gemma3_oracle, images, want) -> None:
    """The comparisons mean something: without crops (the same weights) HF's first token differs."""
    for name in ("wide", "tall", "strip"):
        prompt, idx = CASES[name]
        plain = hf_first_logprobs(gemma3_oracle, prompt, [images[i] for i in idx])
        assert (plain - want[name][1]).abs().max() > 1e-3, name


@pytest.mark.parametrize("budget", [2048, 20, 7])
def test_greedy_equals_hf_for_any_budget(gemma3_pas_dir: Path, images, want, budget: int) -> None:
    """Budgets of 7 and 20 tokens would cut each 16-token block: every block runs whole in one chunk."""
    engine = make_engine(gemma3_pas_dir, max_num_batched_tokens=budget)
    seen = step_sizes(engine)
    for name, (prompt, idx) in CASES.items():
        out = engine.generate(name, prompt, [images[i] for i in idx], sampling=greedy(N, logprobs=TOP))
        assert_same(out, want[name], name)
        assert out.usage.images == len(idx)
    assert max(seen) <= max(budget, 16)
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0


def test_request_spans_share_one_embedding(gemma3_pas_dir: Path) -> None:
    """A cropped image is 1 + crops spans of one content hash, each a block of the one embedding."""
    engine = make_engine(gemma3_pas_dir)
    prompt, idx = CASES["strip"]
    req = engine.inputs.make_request("r", prompt, [sample_images()[i] for i in idx])
    assert len({p.content_hash for p in req.images}) == 1
    spans = [(p.row_offset, p.length, p.total_rows) for p in req.images]
    assert spans == [(16 * k, 16, 80) for k in range(5)]
    assert all(b.offset > a.end for a, b in zip(req.images, req.images[1:], strict=False))  # text between


def test_prefix_hit_ending_inside_a_crop(gemma3_pas_dir: Path, gemma3_pas_oracle) -> None:
    """A second request shares the first's start through a cropped image: the cached blocks end inside a
    crop's block (a head chosen so they do); the rest of that crop is computed from the embedding's rows
    at its offset, attending to the whole block."""
    engine = make_engine(gemma3_pas_dir)
    image = sample_images()[0]
    for pad in range(16):
        head = "<start_of_turn>user\n" + "x " * pad + "ok <start_of_image>"
        first = head + "tell a long story about this<end_of_turn>\n<start_of_turn>model\n"
        second = head + "name two colours you see<end_of_turn>\n<start_of_turn>model\n"
        a = engine.inputs.make_request("a", first, [image]).prompt_token_ids
        req = engine.inputs.make_request("b", second, [image])
        shared = next(i for i, (x, y) in enumerate(zip(a, req.prompt_token_ids, strict=False)) if x != y)
        hit = shared // 16 * 16
        if any(s.row_offset and s.offset < hit < s.end for s in req.images):
            break
    else:
        pytest.fail("no head puts the cache hit inside a crop")
    engine.generate("first", first, [image], sampling=greedy(N))
    out = engine.generate("second", second, [image], sampling=greedy(N, logprobs=TOP))
    assert out.usage.cached_prompt_tokens == hit
    assert_same(out, (gemma3_pas_oracle.generate(second, [image], N),
                      hf_first_logprobs(gemma3_pas_oracle, second, [image])), "second")


def test_concurrent_requests_with_preemption(gemma3_pas_dir: Path, gemma3_pas_oracle, images) -> None:
    """Six requests of cropped images at once in a small KV cache: preempted ones come back and ask for
    their embeddings anew; every block still gets its rows."""
    from tests.oracle import run_all

    engine = make_engine(gemma3_pas_dir, num_kv_blocks=16, max_num_batched_tokens=24, max_num_seqs=4)
    plan = {}
    for i in range(6):
        name = ["wide", "tall", "strip"][i % 3]
        prompt, idx = CASES[name]
        imgs = [images[(j + i) % 4] for j in idx]
        plan[f"r{i}"] = (prompt, imgs)
        engine.add_request(f"r{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == gemma3_pas_oracle.generate(prompt, imgs, N), rid
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0
