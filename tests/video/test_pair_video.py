"""Videos through the running encoder and decoder services: a prompt video and a chat video part give
HF's tokens, a repeated video reuses its KV, a hash-only or corrupt video is one clear INVALID_ARGUMENT,
and nothing is held afterwards."""

from __future__ import annotations

import grpc
import pytest

from common.client import EncoderClient, GenerationResult, generate_request
from common.images import encode_png
from common.pb import common_pb2, decoder_pb2
from tests.integration.harness import Pair
from tests.video.test_engine_video import MIXED_PROMPT, VIDEO, VIDEO_PROMPT, VideoOracle

N = 8


@pytest.fixture(scope="module")
def video_pair(qwen3_model_dir, tmp_path_factory):
    """Encoder + decoder on qwen3-vl-tiny (DeepStack parts and timestamped runs); chunks of 64 tokens."""
    pair = Pair(qwen3_model_dir, tmp_path_factory.mktemp("video-pair"),
                decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "64",
                              "--encoder-timeout", "30"]).start()
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def oracle(qwen3_oracle, qwen3_model_dir):
    return VideoOracle(qwen3_oracle, qwen3_model_dir)


def _generate(pair, request: decoder_pb2.GenerateRequest) -> GenerationResult:
    result = GenerationResult()
    with pair.decoder_client(timeout=300) as client:
        for chunk in client.stub.Generate(request, timeout=300):
            result.add(chunk)
    return result


def test_prompt_video_with_an_image_equals_hf_and_repeat_reuses(video_pair, oracle, qwen_images):
    request = generate_request(MIXED_PROMPT, [encode_png(qwen_images[0])], max_tokens=N)
    request.videos.add(data=VIDEO)
    cold = _generate(video_pair, request)
    assert cold.token_ids == oracle.generate(MIXED_PROMPT, qwen_images[:1], [VIDEO], N)
    warm = _generate(video_pair, request)
    assert warm.token_ids == cold.token_ids and warm.usage.cached_prompt_tokens > 0
    dec, enc = video_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and dec.active_leases == 0 and enc.active_leases == 0


def test_a_new_video_is_sent_ahead_and_encoded_once(video_pair, oracle):
    """The front end sends a new video to its encoder as its request arrives (a Prefetch with the
    settings its plan resolved); the engine's ask by hash joins that work instead of sending the file
    again: one prefetch, one encode, one miss, and HF's tokens. A repeat sends nothing ahead."""
    request = generate_request(VIDEO_PROMPT, max_tokens=N, cache_salt="video-ahead")
    request.videos.add(data=VIDEO)
    with EncoderClient(video_pair.encoder.address, timeout=30) as encoder:
        before = encoder.stats()
        first, second = _generate(video_pair, request), _generate(video_pair, request)
        after = encoder.stats()
    assert first.token_ids == second.token_ids == oracle.generate(VIDEO_PROMPT, [], [VIDEO], N)
    assert after.prefetches - before.prefetches == 1
    assert after.encodes - before.encodes == 1 and after.misses - before.misses == 1
    dec, enc = video_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and dec.active_leases == 0 and enc.active_leases == 0


def test_chat_video_part_equals_hf(video_pair, oracle):
    messages = [decoder_pb2.ChatMessage(role="user", content=[
        decoder_pb2.ContentPart(video=common_pb2.VideoInput(data=VIDEO)),
        decoder_pb2.ContentPart(text="what happens here?")])]
    request = decoder_pb2.GenerateRequest(chat=decoder_pb2.ChatMessages(messages=messages),
                                          sampling=decoder_pb2.SamplingParams(max_tokens=N))
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens here?"}]}]
    text = oracle.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert _generate(video_pair, request).token_ids == oracle.generate(text, [], [VIDEO], N)


@pytest.mark.parametrize("video, match", [
    (common_pb2.VideoInput(content_hash="ab" * 32), "video 0: send the video's bytes"),
    (common_pb2.VideoInput(data=b"\x00\x00\x00\x18ftypmp42 not really"), "video 0"),
])
def test_bad_videos_are_invalid_argument(video_pair, video, match):
    request = generate_request(VIDEO_PROMPT, max_tokens=N)
    request.videos.append(video)
    with pytest.raises(grpc.RpcError) as err:
        _generate(video_pair, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()
    dec, enc = video_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and enc.active_leases == 0
