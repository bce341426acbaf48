"""GPU preprocessing (--preprocess torch): resize, crop and normalise on CUDA within the stated tolerance
of the HF processor's pixel values, and the encoder's pinned, stream-ordered path end to end."""

from __future__ import annotations

import io

import pytest
import torch

from common.families.llava.encoder import LlavaVisionEncoder as VisionEncoder
from common.pb import common_pb2
from common.vision.pixels import TorchPixelProcessor, to_uint8_chw
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request
from tests.encoder.test_pixels import SIZES, _clip_processor, _image, assert_within_tolerance
from tests.encoder.test_vision import _hf_features

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("side", [28, 336])
def test_cuda_pixels_within_the_stated_tolerance_of_hf(side):
    hf = _clip_processor(side)
    tp = TorchPixelProcessor(hf)
    for width, height in SIZES:
        for kind in ("noise", "gradient"):
            img = _image(kind, width, height)
            ref = hf(images=[img], return_tensors="pt")["pixel_values"]
            got = tp([to_uint8_chw(img).cuda()]).cpu()
            assert_within_tolerance(tp, got, ref, kind, (side, width, height, kind))
            if (width, height) == (side, side):
                assert torch.equal(got, ref)


def test_auto_picks_torch_on_cuda_in_half_precision_only(tiny_model_dir):
    assert VisionEncoder(tiny_model_dir, "cuda", torch.bfloat16).preprocess_mode == "torch"
    assert VisionEncoder(tiny_model_dir, "cuda", torch.float32).preprocess_mode == "hf"


def test_encoder_on_cuda_with_torch_preprocessing_matches_hf(tiny_model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, device="cuda", cache_bytes=1 << 20,
                                           preprocess="torch", max_batch_images=8))
    try:
        from common.transport import import_embedding

        vision = harness.servicer.vision
        side = vision.config.vision_config.image_size
        images = [_image("noise", side, side, seed=s) for s in range(3)] + [_image("noise", 40, 32, seed=9)]
        pngs = []
        for img in images:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            pngs.append(buf.getvalue())
        resp = harness.stub.Encode(encode_request(*pngs, accept=[common_pb2.TRANSPORT_INLINE]), timeout=60)
        got = [import_embedding(r) for r in resp.embeddings]
        want = _hf_features(tiny_model_dir, vision.preprocess(images))
        for g, w in zip(got[:3], want[:3], strict=True):  # no resampling: same pixels
            torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[3].cpu(), want[3], rtol=0, atol=0.05)  # resized: within tolerance
    finally:
        harness.close()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_graphed_tower_matches_eager(tiny_model_dir, dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    vision = VisionEncoder(tiny_model_dir, "cuda", dtype)
    assert vision.capture_graphs(8) and vision.graphs.buckets == [1, 2, 4, 8]
    side = vision.config.vision_config.image_size
    images = [_image("noise", side, side, seed=s) for s in range(9)]
    prepared = [vision.prepare(i) for i in images]
    for n in (1, 3, 8, 9):  # a bucket exactly, padded into 4, the largest, past it (eager)
        eager = vision.encode_prepared(prepared[:n])
        graphed = vision.encode_prepared(prepared[:n], use_graphs=True)
        for e, g in zip(eager, graphed, strict=True):
            torch.testing.assert_close(g.float(), e.float(), rtol=tol, atol=tol)
    # a replay's result is a copy: the next replay does not change it
    first = vision.encode_prepared(prepared[:1], use_graphs=True)[0].clone()
    kept = vision.encode_prepared(prepared[:1], use_graphs=True)[0]
    vision.encode_prepared(prepared[5:6], use_graphs=True)
    assert torch.equal(kept, first)


def test_encoder_service_captures_graphs_unless_eager(tiny_model_dir):
    for eager in (False, True):
        harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, device="cuda", dtype="bfloat16",
                                               cache_bytes=1 << 20, max_batch_images=4, enforce_eager=eager))
        try:
            assert (harness.servicer.vision.graphs is None) == eager
            img = _image("noise", 50, 40, seed=5)
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            resp = harness.stub.Encode(encode_request(buf.getvalue(), accept=[common_pb2.TRANSPORT_INLINE]),
                                       timeout=60)
            assert resp.embeddings[0].shape[0] == harness.servicer.vision.num_image_tokens
        finally:
            harness.close()
