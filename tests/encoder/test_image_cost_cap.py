"""An image whose estimated tower time is over --max-image-seconds is refused before any work (issue 63):
INVALID_ARGUMENT naming the image, the estimate and the flag, through Encode (with its bytes) and skipped
by a Prefetch; nothing is produced. The tower's measured cost is set by the test (the worker's tower
seconds), not timed; a cached image is still served."""

from __future__ import annotations

import grpc
import pytest

from common.pb import common_pb2, encoder_pb2
from encoder_svc.image_cost import ImageCostCap
from tests.encoder.conftest import encode_request, image_bytes


def test_the_estimate_is_size_times_the_measured_cost():
    measured = [(0.0, 0)]
    cap = ImageCostCap(10.0, lambda: measured[0])
    assert cap.seconds_for(1000) is None  # nothing measured: nothing refused
    cap.check(0, 64, 64, 10**9)
    measured[0] = (2.0, 1000)  # 2 ms a byte
    assert cap.seconds_for(5000) == pytest.approx(10.0)
    cap.check(0, 64, 64, 5000)
    with pytest.raises(Exception, match=r"image 3: 80x60 would take an estimated 12 s.*--max-image-seconds"):
        cap.check(3, 60, 80, 6000)
    ImageCostCap(0.0, lambda: measured[0]).check(0, 64, 64, 10**9)  # 0: no cap


def test_an_image_over_the_cap_is_refused_before_any_work(encoder, monkeypatch):
    servicer = encoder.servicer
    cached = image_bytes(6501)
    encoder.release_all(encoder.stub.Encode(encode_request(cached), timeout=60))
    # The tower's cost so far: one image's embedding bytes took 100 s, over the cap of 60 s.
    monkeypatch.setattr(servicer, "cost_cap", ImageCostCap(
        60.0, lambda: (100.0, servicer.vision.embedding_nbytes)))
    misses, encodes = encoder.stats().misses, encoder.stats().encodes
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(encode_request(image_bytes(6502)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 0:" in err.value.details() and "--max-image-seconds" in err.value.details()
    assert encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=image_bytes(6503))], needed_now=True), timeout=60).accepted == 0
    stats = encoder.stats()
    assert (stats.misses, stats.encodes) == (misses, encodes)  # nothing was produced
    encoder.release_all(encoder.stub.Encode(encode_request(cached), timeout=60))  # a hit costs no tower
