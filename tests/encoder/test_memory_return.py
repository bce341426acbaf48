"""The encoder gives host memory back after large jobs (issue 38, item 5): the vision worker after a batch
whose inputs were large, once those inputs are dropped, and not after small batches; a decode process
after a large image. Counted in trims (the RSS itself depends on glibc and the host)."""

from __future__ import annotations

import weakref

import torch

from common.freed_memory import LARGE_JOB_BYTES
from common.images import ImageLimits
from encoder_svc import decode_child, memory_return
from encoder_svc.decode_child import DECODE, DECODED, decode_job
from encoder_svc.worker import DEMAND
from tests.encoder.conftest import image_bytes
from tests.encoder.test_worker import _FakeVision, _running_worker, _submit


class _SizedVision(_FakeVision):
    """Prepares each "image" (its key) as a float32 tensor of the size its key names; keeps weak
    references to them, to see when the worker drops them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.inputs: list[weakref.ref] = []

    def prepare(self, image):
        tensor = torch.zeros(int(image.split(":")[1]) // 4)
        self.inputs.append(weakref.ref(tensor))
        return tensor

    def encode_prepared(self, images, use_graphs=False):
        return [torch.ones(4, 8) for _ in images]


def test_a_large_batch_gives_memory_back_once_its_inputs_are_gone(monkeypatch) -> None:
    trims: list[bool] = []
    vision = _SizedVision()
    monkeypatch.setattr(memory_return, "release_freed_memory",
                        lambda: trims.append(all(ref() is None for ref in vision.inputs)) or True)
    with _running_worker(vision, arena_bytes=1 << 20) as (cache, worker):
        _submit(cache, worker, "small:4096", DEMAND).result(10)
        assert trims == []  # small batches go without
        _submit(cache, worker, f"large:{LARGE_JOB_BYTES}", DEMAND).result(10)
        worker.stop()  # the batch's end has run
    assert trims == [True], "no trim after a large batch, or one while its inputs were still held"


def test_a_decode_process_gives_memory_back_after_a_large_image(tmp_path, monkeypatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(decode_child, "release_freed_memory", lambda: trims.append(1) or True)
    monkeypatch.setattr(decode_child, "LARGE_JOB_BYTES", 40 * 32 * 3)  # a 40x32 image is "large" here
    segment = tmp_path / "slots"
    for size, expected in (((8, 8), 0), ((40, 32), 1)):
        data = image_bytes(1, size)
        segment.write_bytes(data + bytes(1 << 16))
        reply = decode_child._run_decode_job(decode_job(7, 0, len(data), 1 << 16, "fp", "", str(segment)),
                                             ImageLimits())
        assert reply[:1] == DECODE and DECODED.unpack_from(reply, 1)[1:3] == size
        assert len(trims) == expected
