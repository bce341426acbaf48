"""The decoder's input checks for Phi-4-MM image requests, all before any pixel is decoded or any token is
made: header caps, the per-image token cap, an aspect ratio HF refuses, hash-only images sized by the grid
the encoder reports; audio refused by name in chat parts, prompts, prompt token ids and the gateway's OpenAI
parts."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from common.images import ImageLimits, encode_png
from decoder_svc.engine.config import EngineConfig
from decoder_svc.engine.input_processor import InputProcessor
from decoder_svc.engine.sampling_params import InvalidRequestError
from decoder_svc.tokenization import PromptError
from tests.phi4mm.images import noise_image

PROMPT = "<|user|><|image|>what is it?<|end|><|assistant|>"


def _inputs(model: Path, **kw) -> InputProcessor:
    config = EngineConfig(model=model, num_kv_blocks=8, **kw)
    return InputProcessor.for_model(config, kv_capacity_tokens=1 << 16)


@pytest.fixture(scope="module")
def inputs(phi4_tiny_dir: Path) -> InputProcessor:
    """1000 image tokens per image at most; 20 Mpx per image at most."""
    return _inputs(phi4_tiny_dir, max_image_tokens=1000, image_limits=ImageLimits(max_pixels=20_000_000))


def test_caps_refuse_from_the_header(inputs):
    bomb = encode_png(Image.new("1", (6000, 6000)))  # 36 Mpx in a few KiB
    with pytest.raises(InvalidRequestError, match="image 0: .*more than the 20000000 pixels"):
        inputs.make_request("a", PROMPT, [bomb])
    with pytest.raises(InvalidRequestError, match="image 0: 1449 image tokens; at most 1000"):
        inputs.make_request("b", PROMPT, [encode_png(noise_image(1000, 500, 1))])
    with pytest.raises(InvalidRequestError, match="image 0: .*too extreme"):
        inputs.make_request("c", PROMPT, [encode_png(noise_image(5000, 8, 1))])
    ok = inputs.make_request("d", PROMPT, [encode_png(noise_image(300, 200, 1))])
    assert ok.images[0].length == inputs.layout.tokens_for_size(300, 200) == 460


def test_a_hash_only_image_takes_the_grid_the_encoder_reports(inputs):
    key = "ab" * 32
    with pytest.raises(InvalidRequestError, match="grid of content hash .* is unknown"):
        inputs.make_request("a", PROMPT, [key])
    req = inputs.make_request("b", PROMPT, [key], known_grids={key: (1, 11, 16)})
    assert req.images[0].length == 11 * 16 + 11 + 273 and req.images[0].content_hash == key
    with pytest.raises(InvalidRequestError, match="dynamic_hd=16"):  # 5 x 4 crops: more than 16
        inputs.make_request("c", PROMPT, [key], known_grids={key: (1, 80, 64)})


def test_audio_is_refused_by_name(inputs):
    audio_part = [{"role": "user", "content": [{"type": "text", "text": "hear"}, {"type": "audio"}]}]
    with pytest.raises(PromptError, match=r"message 0 part 1: audio input \(audio parts\) is not served"):
        inputs.make_request("a", messages=audio_part)
    with pytest.raises(PromptError, match=r"<\|audio\|>, the placeholder of audio input"):
        inputs.make_request("b", "<|user|><|audio|>transcribe<|end|><|assistant|>")
    with pytest.raises(PromptError, match="audio"):  # a chat text part that spells the token
        inputs.make_request("c", messages=[{"role": "user", "content": "say <|audio|>"}])


def test_the_gateway_refuses_openai_audio_parts_naming_them():
    from gateway.errors import APIError
    from gateway.schemas import ChatCompletionRequest, parse_body

    for part in ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}):
        content = [{"type": "text", "text": "hi"}, part]
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        with pytest.raises(APIError) as err:
            parse_body(ChatCompletionRequest, body)
        assert err.value.status == 400 and err.value.param == f"messages.0.content.1.{part['type']}"
        assert f"audio input ({part['type']} parts) is not served" in str(err.value)


def test_token_id_prompts_refuse_every_placeholder_the_family_declares(inputs):
    """The audio placeholder's id is refused as a prompt token id, as the image placeholder's is: each
    would run on an input nobody sent (audio: one no service takes)."""
    tokenizer = inputs.tokenizer
    audio_id = tokenizer.tokenizer.convert_tokens_to_ids("<|audio|>")
    assert tokenizer.placeholder_token_ids == {tokenizer.image_token_id: "image", audio_id: "audio"}
    with pytest.raises(InvalidRequestError, match=f"token 1: id {audio_id} is the placeholder of audio"):
        inputs.make_request("a", prompt_token_ids=[1, audio_id])
    with pytest.raises(InvalidRequestError, match="image or video placeholder"):
        inputs.make_request("i", prompt_token_ids=[1, tokenizer.image_token_id])
    assert inputs.make_request("t", prompt_token_ids=[1, 2]).prompt_token_ids == [1, 2]
