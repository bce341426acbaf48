"""Videos through the encoder service (a real gRPC server in-process, CPU, SHM arena), on qwen2.5-vl-tiny
and qwen3-vl-tiny: each video is one cache entry whose ref carries the grid and timing common/video
computes and whose rows (every part, for Qwen3-VL) equal HF's get_video_features of the same patch rows
exactly (fp32 CPU); a second Encode by content hash is a hit; Lookup answers grid and timing; bad videos
and videos over a cap are INVALID_ARGUMENT naming the video, before any frame is decoded, leaving no
lease, and the service keeps serving."""

from __future__ import annotations

import re
from dataclasses import replace

import grpc
import pytest
import torch

from common.families.qwen2_5_vl.video_config import load_qwen_video_config
from common.images import ImageLimits, encode_png
from common.pb import common_pb2, encoder_pb2
from common.transport import import_embedding
from common.video import (
    plan_video,
    read_video,
    video_patches,
    video_request_config,
)
from common.video.hashing import hash_video_bytes
from common.video.limits import VideoLimits
from encoder_svc import videos as videos_module
from encoder_svc.config import EncoderConfig
from tests.encoder.conftest import EncoderHarness
from tests.oracle import make_image
from tests.video.media import make_audio_only, make_video

SHM, INLINE = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE
# 3.5 s at 10 fps, 240x180: Qwen2.5-VL samples 6 frames (grid 3 x 12 x 18: several attention windows a
# group); Qwen3-VL 7 (the last repeated: grid 4 x 12 x 16)
VIDEO = make_video(35, fps=10, width=240, height=180)
LIMITS = VideoLimits(max_per_request=3)


@pytest.fixture(scope="module", params=["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def preset(request):
    """(encoder harness, HF model, checkpoint dir) of one preset."""
    if request.param == "qwen2.5-vl-tiny":
        model_dir, hf = request.getfixturevalue("qwen_model_dir"), request.getfixturevalue("qwen_oracle")
    else:
        model_dir, hf = request.getfixturevalue("qwen3_model_dir"), request.getfixturevalue("qwen3_oracle")
    harness = EncoderHarness(EncoderConfig(
        model=model_dir, cache_bytes=64 << 20, lease_ttl_s=30, decode_processes=0,
        limits=ImageLimits(max_images_per_request=2), video_limits=LIMITS))
    yield harness, hf.model, model_dir
    harness.close()


@pytest.fixture
def encoder(preset):
    """The preset's encoder; after each test no lease may be left active."""
    harness = preset[0]
    yield harness
    assert harness.stats().active_leases == 0, "a test (or the server) leaked a lease"


def _encode(encoder, *videos, images=(), accept=SHM, salt="", timeout=120) -> encoder_pb2.EncodeResponse:
    return encoder.stub.Encode(encoder_pb2.EncodeRequest(
        images=[common_pb2.ImageInput(data=d) for d in images], videos=list(videos), accept=[accept],
        cache_salt=salt), timeout=timeout)


def _hf_features(model, rows: torch.Tensor, grid) -> torch.Tensor:
    """HF's get_video_features of one video as [rows, hidden], or [parts, rows, hidden] with DeepStack."""
    with torch.no_grad():
        out = model.model.get_video_features(pixel_values_videos=rows, video_grid_thw=torch.tensor([grid]))
    merged = torch.cat(list(out.pooler_output))
    levels = getattr(out, "deepstack_features", None)
    if not levels:
        return merged
    return torch.stack([merged, *(torch.cat(list(level)) if isinstance(level, (list, tuple)) else level
                                  for level in levels)])


def _expected(model_dir, data: bytes, salt: str = "", **settings):
    """common/video's plan (grid, timing, hash) of data under the request's settings."""
    config = video_request_config(load_qwen_video_config(model_dir), limits=LIMITS, **settings)
    return config, plan_video(data, config, _fingerprint(model_dir), salt, LIMITS)


def _fingerprint(model_dir) -> str:
    from common.checkpoint import model_fingerprint

    return model_fingerprint(model_dir)


def _assert_ref(ref: common_pb2.EmbeddingRef, plan) -> None:
    assert list(ref.grid_thw) == list(plan.grid) and ref.grid_thw[0] > 1
    assert list(ref.video_timestamps) == list(plan.timing.timestamps)
    assert ref.second_per_grid == plan.timing.second_per_grid > 0
    assert ref.content_hash == plan.content_hash and ref.shape[-2] == plan.num_tokens


def test_encode_equals_hf_then_hits_by_hash_and_lookup(encoder, preset):
    _, model, model_dir = preset
    config, plan = _expected(model_dir, VIDEO)
    encodes = encoder.stats().encodes
    first = _encode(encoder, common_pb2.VideoInput(data=VIDEO))
    (ref,) = first.embeddings
    assert not ref.cache_hit and ref.lease_id and ref.WhichOneof("location") == "shm"
    _assert_ref(ref, plan)
    rows, grid = video_patches(read_video(VIDEO, config, "fp").decoded.frames, config)
    assert tuple(grid) == tuple(plan.grid)
    expected = _hf_features(model, rows, grid)
    got = import_embedding(ref)
    assert tuple(got.shape) == tuple(expected.shape) == tuple(ref.shape)
    assert (got - expected).abs().max().item() == 0.0  # exact: fp32 on CPU, HF's own arithmetic
    assert encoder.stats().encodes == encodes + 1
    assert encoder.release_all(first) == 1

    by_hash = _encode(encoder, common_pb2.VideoInput(content_hash=ref.content_hash), accept=INLINE)
    (hit,) = by_hash.embeddings
    assert hit.cache_hit and not hit.lease_id and hit.inline_data
    _assert_ref(hit, plan)
    assert torch.equal(import_embedding(hit), got)
    assert encoder.stats().encodes == encodes + 1, "a hit must not run the tower"

    lookup = encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[ref.content_hash, "ab" * 32]),
                                 timeout=10)
    assert list(lookup.cached) == [True, False]
    grid_msg, absent = lookup.grids
    assert list(grid_msg.thw) == list(plan.grid) and grid_msg.second_per_grid == plan.timing.second_per_grid
    assert list(grid_msg.video_timestamps) == list(plan.timing.timestamps)
    assert not absent.thw and not absent.video_timestamps and absent.second_per_grid == 0


def test_request_settings_images_first_and_salt(encoder, preset):
    _, _, model_dir = preset
    settings = {"fps": 1.0, "max_frames": 2}
    _, plan = _expected(model_dir, VIDEO, salt="tenant", **settings)
    _, default = _expected(model_dir, VIDEO, salt="tenant")
    assert plan.content_hash != default.content_hash and plan.grid[0] == 1
    png = encode_png(make_image(1, (64, 64)))
    response = _encode(encoder, common_pb2.VideoInput(data=VIDEO),
                       common_pb2.VideoInput(data=VIDEO, **settings), images=[png], salt="tenant")
    image, video, narrowed = response.embeddings
    assert not image.video_timestamps and image.second_per_grid == 0 and list(image.grid_thw)[0] == 1
    _assert_ref(video, default)
    assert list(narrowed.grid_thw) == list(plan.grid) and narrowed.content_hash == plan.content_hash
    assert list(narrowed.video_timestamps) == list(plan.timing.timestamps)
    assert plan.content_hash == hash_video_bytes(VIDEO, video_request_config(
        load_qwen_video_config(model_dir), limits=LIMITS, **settings), _fingerprint(model_dir), "tenant")
    assert encoder.release_all(response) == 3
    # the salt scopes a hash: another tenant cannot reach it
    with pytest.raises(grpc.RpcError) as err:
        _encode(encoder, common_pb2.VideoInput(content_hash=plan.content_hash))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "video 0" in err.value.details()


def test_a_video_hash_given_as_an_image_is_invalid_argument(encoder):
    response = _encode(encoder, common_pb2.VideoInput(data=VIDEO), salt="kinds")
    (video,) = response.embeddings
    encoder.release_all(response)
    image = encode_png(make_image(2, (64, 64)))
    image_hash = _encode(encoder, images=[image], accept=INLINE, salt="kinds").embeddings[0].content_hash
    for request, words in (
            (encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(content_hash=video.content_hash)]),
             "image 0: content hash .* names a video"),
            (encoder_pb2.EncodeRequest(videos=[common_pb2.VideoInput(content_hash=image_hash)]),
             "video 0: content hash .* names an image")):
        request.accept.append(INLINE)
        request.cache_salt = "kinds"
        with pytest.raises(grpc.RpcError) as err:
            encoder.stub.Encode(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(words, err.value.details()), err.value.details()
    assert _encode(encoder, common_pb2.VideoInput(content_hash=video.content_hash), accept=INLINE,
                   salt="kinds").embeddings[0].cache_hit  # still served as what it is


def test_prefetch_then_encode_runs_the_tower_once(encoder):
    data = make_video(30, fps=10, width=96, height=64)
    encodes = encoder.stats().encodes
    accepted = encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        videos=[common_pb2.VideoInput(data=data)], cache_salt="pf"), timeout=60).accepted
    assert accepted == 1
    response = _encode(encoder, common_pb2.VideoInput(data=data), salt="pf")
    assert encoder.stats().encodes == encodes + 1
    encoder.release_all(response)


def test_a_video_miss_counts_its_lane_and_tower_in_their_stages(encoder):
    """A video's wait splits into preprocess (its frames decoded on the lane) and tower, as an image's does;
    without the worker's stamps of its job both would be zero and the time would land in handoff."""
    before = encoder.stats().stage_seconds
    response = _encode(encoder, common_pb2.VideoInput(data=VIDEO), salt="stages")
    assert not response.embeddings[0].cache_hit
    encoder.release_all(response)
    after = encoder.stats().stage_seconds
    delta = {stage: after[stage] - before.get(stage, 0.0) for stage in after}
    assert delta["preprocess"] > 0 and delta["tower"] > 0, delta


@pytest.fixture
def no_decoding(monkeypatch):
    """Counts frame decodes the encoder starts."""
    calls = []
    real = videos_module.decode_video

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(videos_module, "decode_video", counted)
    return calls


SMALL = make_video(30, fps=10, width=64, height=48)  # 3 s, 30 frames of 64x48


@pytest.mark.parametrize("case, words", [
    ("corrupt", "cannot read the video container"),
    ("codec", "codec ffv1 is not accepted"),
    ("no_stream", "no video stream"),
    ("bytes", f"exceeds the limit of {len(SMALL) - 1}"),
    ("seconds", "exceeds the limit of 2.5 s"),
    ("stream_frames", "exceeds the limit of 29 frames"),
    ("frame_pixels", "have more than the 3071 pixels"),
    ("max_frames", "max_frames 769 is above the server's limit of 768"),
    ("max_pixels", "is above the model's"),
    ("count", "4 videos in one request; the limit is 3"),
])
def test_bad_video_is_invalid_argument_before_decoding(encoder, monkeypatch, no_decoding, case, words):
    servicer = encoder.servicer
    bad = common_pb2.VideoInput(data=SMALL)
    caps = {"bytes": {"max_bytes": len(SMALL) - 1}, "seconds": {"max_duration_s": 2.5},
            "stream_frames": {"max_stream_frames": 29}, "frame_pixels": {"max_pixels": 64 * 48 - 1}}
    if case in caps:
        monkeypatch.setattr(servicer, "video_limits", replace(LIMITS, **caps[case]))
    elif case == "corrupt":
        bad.data = SMALL[:8] + bytes(range(256)) * 16
    elif case == "codec":
        bad.data = make_video(4, codec="ffv1", fmt="matroska")
    elif case == "no_stream":
        bad.data = make_audio_only()
    elif case == "max_frames":
        bad.max_frames = 769
    elif case == "max_pixels":
        bad.max_pixels = servicer.video_config.geometry.max_pixels + 1
    good = common_pb2.VideoInput(data=make_video(20, fps=10, width=32, height=32))
    videos = [good, bad] + ([bad, bad] if case == "count" else [])
    before = encoder.stats()
    with pytest.raises(grpc.RpcError) as err:
        _encode(encoder, *videos)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert words in details and (case == "count" or details.startswith("video 1: ")), details
    after = encoder.stats()
    assert not no_decoding, "a frame was decoded"
    assert (after.misses, after.encodes, after.active_leases) == (before.misses, before.encodes, 0)


def test_a_stream_broken_after_its_header_fails_alone(encoder):
    # Matroska's header says 4 s (40 frames); the last third of the file is gone, frames included
    data = make_video(40, fps=10, fmt="matroska")
    broken = common_pb2.VideoInput(data=data[: len(data) * 2 // 3])
    with pytest.raises(grpc.RpcError) as err:
        _encode(encoder, common_pb2.VideoInput(data=make_video(20, fps=10, width=48, height=32)), broken)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("video 1: the video stream ended after"), err.value.details()
    response = _encode(encoder, common_pb2.VideoInput(data=SMALL))  # still serving
    assert len(response.embeddings) == 1
    encoder.release_all(response)
