"""The per-request pan-and-scan switch (ImageInput.pan_and_scan; vLLM's mm_processor_kwargs do_pan_and_scan)
against HF, fp32, CPU, in-process engine.

Two checkpoints with the same weights and crop rule (crops from 32 px, conftest.py): gemma3_pas_dir turns
crops on in its image processor config, gemma3_pas_off_dir turns them off. A request that turns crops on
over the second equals HF with crops (the oracle passes the settings explicitly); one that turns them off
over the first equals HF without. The same image with and without crops in one batch: two embeddings,
two content hashes. A model without crops refuses the switch naming the image.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from common.errors import as_service_error
from common.families.oracle import greedy_new_tokens
from common.pb import common_pb2, decoder_pb2
from decoder_svc.engine import InvalidRequestError
from decoder_svc.engine.input_processor import ImageOptions
from decoder_svc.wire import parse_request
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_image_generate import TOP, assert_same, make_engine
from tests.gemma3.test_pan_and_scan import CASES, hf_first_logprobs
from tests.oracle import greedy, run_all

N = 10
ON, OFF = ImageOptions(pan_and_scan=True), ImageOptions(pan_and_scan=False)
SHOWN = ("wide", "strip", "two", "square")  # cropped 2, 4, 2 + 2 and 0 times when crops are on


@pytest.fixture(scope="module")
def images():
    return sample_images()


def _want(oracle, images, names=SHOWN) -> dict:
    return {name: (oracle.generate(prompt, [images[i] for i in idx], N),
                   hf_first_logprobs(oracle, prompt, [images[i] for i in idx]))
            for name, (prompt, idx) in CASES.items() if name in names}


@pytest.fixture(scope="module")
def want_on(gemma3_pas_oracle, images) -> dict:
    """HF with crops (the pan-and-scan checkpoint's oracle: the same weights and crop rule)."""
    return _want(gemma3_pas_oracle, images)


@pytest.fixture(scope="module")
def want_off(gemma3_oracle, images) -> dict:
    """HF without crops (the same weights)."""
    return _want(gemma3_oracle, images)


def test_the_two_answers_differ(want_on, want_off) -> None:
    """The comparisons below mean something: with and without crops HF's answers differ."""
    for name in ("wide", "strip", "two"):
        assert (want_on[name][1] - want_off[name][1]).abs().max() > 1e-3, name


def test_switch_on_over_a_checkpoint_with_crops_off(gemma3_pas_off_dir: Path, images, want_on,
                                                    want_off) -> None:
    engine = make_engine(gemma3_pas_off_dir, max_num_batched_tokens=20)
    for name in SHOWN:
        prompt, idx = CASES[name]
        imgs = [images[i] for i in idx]
        on = engine.generate(f"{name}-on", prompt, imgs, sampling=greedy(N, logprobs=TOP),
                             image_options=[ON] * len(imgs))
        assert_same(on, want_on[name], name)
        plain = engine.generate(f"{name}-plain", prompt, imgs, sampling=greedy(N, logprobs=TOP))
        assert_same(plain, want_off[name], name)  # unset: the checkpoint's (off)
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0


def test_switch_off_over_a_checkpoint_with_crops_on(gemma3_pas_dir: Path, images, want_on, want_off) -> None:
    engine = make_engine(gemma3_pas_dir)
    for name in SHOWN:
        prompt, idx = CASES[name]
        imgs = [images[i] for i in idx]
        off = engine.generate(f"{name}-off", prompt, imgs, sampling=greedy(N, logprobs=TOP),
                              image_options=[OFF] * len(imgs))
        assert_same(off, want_off[name], name)
        plain = engine.generate(f"{name}-plain", prompt, imgs, sampling=greedy(N, logprobs=TOP))
        assert_same(plain, want_on[name], name)  # unset: the checkpoint's (on)
    assert engine.stats().kv_blocks_used == 0


def test_one_image_with_and_without_crops_in_one_batch(gemma3_pas_off_dir: Path, images, want_on,
                                                       want_off) -> None:
    """Both requests queued before the first step: the image's two embeddings never mix, and one image of
    each kind per prompt works too (the "two" case, its first image cropped and its second not)."""
    engine = make_engine(gemma3_pas_off_dir)
    prompt, idx = CASES["wide"]
    imgs = [images[i] for i in idx]
    on = engine.add_request("on", prompt, imgs, sampling=greedy(N), image_options=[ON])
    off = engine.add_request("off", prompt, imgs, sampling=greedy(N), image_options=[OFF])
    mixed_prompt, mixed_idx = CASES["two"]
    mixed = engine.add_request("mixed", mixed_prompt, [images[i] for i in mixed_idx], sampling=greedy(N),
                               image_options=[ON, OFF])
    assert {p.content_hash for p in on.images} != {p.content_hash for p in off.images}
    assert [p.length for p in on.images] == [16, 16, 16] and [p.length for p in off.images] == [16]
    assert len(mixed.images) == 3 + 1 and len({p.content_hash for p in mixed.images}) == 2
    results = run_all(engine)
    assert results["on"]["tokens"] == want_on["wide"][0]
    assert results["off"]["tokens"] == want_off["wide"][0]
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0


def _hf_mixed(oracle, layout, prompt: str, imgs: list,
              crops_on: list[bool]) -> tuple[list[int], torch.Tensor]:
    """HF on a prompt whose images are cropped or not one by one (HF's processor crops every image of a
    call or none): the text Gemma3Processor writes for each image's crop count (the layout's expansion,
    checked against HF's in test_pan_and_scan.py), each image's pixel_values from HF's image processor
    with its own choice, joined in order."""
    crops, pixels = [], []
    for image, on in zip(imgs, crops_on, strict=True):
        kwargs = oracle.crop_kwargs if on else {"do_pan_and_scan": False}
        out = oracle.image_processor(images=[image], return_tensors="pt", **kwargs)
        crops.append(int(out["num_crops"][0]) if on else 0)
        pixels.append(out["pixel_values"])
    enc = oracle.tokenizer(layout.expand_prompt(prompt, len(imgs), crops), return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
              "token_type_ids": (enc["input_ids"] == oracle.model.config.image_token_index).long(),
              "pixel_values": torch.cat(pixels)}
    with torch.no_grad():
        first = oracle.model(**inputs).logits[0, -1].float().log_softmax(-1)
    return greedy_new_tokens(oracle.model, inputs, N), first


def test_one_request_with_a_cropped_and_a_plain_image_equals_hf(gemma3_pas_off_dir: Path,
                                                               gemma3_pas_oracle, images, want_on) -> None:
    """The first image cropped, the second not, in one prompt and at a budget that would cut blocks."""
    prompt, idx = CASES["two"]
    imgs = [images[i] for i in idx]
    engine = make_engine(gemma3_pas_off_dir, max_num_batched_tokens=20)
    layout = engine.inputs.layout
    # all on through this helper equals the oracle's own (crops on for every image): the helper is HF's
    assert _hf_mixed(gemma3_pas_oracle, layout, prompt, imgs, [True, True])[0] == want_on["two"][0]
    want = _hf_mixed(gemma3_pas_oracle, layout, prompt, imgs, [True, False])
    assert want[0] != want_on["two"][0] or (want[1] - want_on["two"][1]).abs().max() > 1e-3
    out = engine.generate("mixed", prompt, imgs, sampling=greedy(N, logprobs=TOP), image_options=[ON, OFF])
    assert_same(out, want, "mixed")
    assert engine.stats().kv_blocks_used == 0


def test_content_hashes(gemma3_pas_dir: Path, gemma3_pas_off_dir: Path, images) -> None:
    """The hash follows the image's choice, not the checkpoint's default: the same bytes with crops on are
    the same embedding (and hash) over either checkpoint, and differ from the same bytes without."""
    def hash_of(model_dir: Path, options: ImageOptions | None) -> str:
        engine = make_engine(model_dir)
        opts = [options] if options is not None else None
        return engine.inputs.make_request("h", "<start_of_image>", [images[0]], image_options=opts
                                          ).images[0].content_hash

    on_default = hash_of(gemma3_pas_dir, None)
    assert hash_of(gemma3_pas_off_dir, ON) == on_default == hash_of(gemma3_pas_dir, ON)
    off_default = hash_of(gemma3_pas_off_dir, None)
    assert hash_of(gemma3_pas_dir, OFF) == off_default == hash_of(gemma3_pas_off_dir, OFF)
    assert on_default != off_default


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen_model_dir"])
def test_the_switch_on_a_model_without_crops_is_invalid_argument(request, fixture: str) -> None:
    """LLaVA and Qwen2.5-VL: pan_and_scan true is refused naming the image (INVALID_ARGUMENT at the
    service); false asks for what the model does anyway and is accepted."""
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource
    from tests.oracle import make_image

    model_dir = request.getfixturevalue(fixture)
    config = EngineConfig(model=model_dir, num_kv_blocks=64)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    grpc_request = decoder_pb2.GenerateRequest(prompt="<image> <image> hi")
    for seed, flag in ((1, False), (2, True)):
        grpc_request.images.add(data=_png(make_image(seed, (32, 32))), pan_and_scan=flag)
    parsed = parse_request(grpc_request)
    assert [o.pan_and_scan for o in parsed.image_options] == [False, True]
    with pytest.raises(InvalidRequestError, match="image 1: pan_and_scan") as caught:
        engine.inputs.make_request("r", parsed.prompt, parsed.images, image_options=parsed.image_options)
    assert as_service_error(caught.value).code == grpc.StatusCode.INVALID_ARGUMENT
    options = parsed.image_options[:1]  # false accepted; image 1 unset
    req = engine.inputs.make_request("r", parsed.prompt, parsed.images, image_options=options)
    assert len({p.content_hash for p in req.images}) == 2


def test_unset_is_not_false_on_the_wire() -> None:
    """proto3 presence: an ImageInput without pan_and_scan leaves the checkpoint's choice."""
    image = common_pb2.ImageInput(data=b"x")
    assert not image.HasField("pan_and_scan")
    parsed = parse_request(decoder_pb2.GenerateRequest(prompt="<image>", images=[image]))
    assert parsed.image_options[0].pan_and_scan is None


def _png(image) -> bytes:
    from common.images import encode_png

    return encode_png(image)


def test_a_hash_only_image_keeps_the_choice_it_was_hashed_under(gemma3_pas_off_dir: Path, images,
                                                                 want_on) -> None:
    """The content hash names the cropped embedding: sent again by hash alone, without the switch, the
    image is laid out by the grid remembered for that hash (its crops), not the checkpoint's default."""
    engine = make_engine(gemma3_pas_off_dir)
    prompt, idx = CASES["wide"]
    first = engine.generate("bytes", prompt, [images[i] for i in idx], sampling=greedy(N),
                            image_options=[ON])
    assert first.new_token_ids == want_on["wide"][0]
    key = engine.inputs.make_request("k", prompt, [images[i] for i in idx], image_options=[ON]).images[0]
    again = engine.generate("hash", prompt, [key.content_hash], sampling=greedy(N))
    assert not again.error and again.new_token_ids == want_on["wide"][0]
