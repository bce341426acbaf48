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


# --- bursts of image requests (issue 67: a flood of distinct 1344x1344 images left the encoders +8-11%) ---

_ARENAS = """
import ctypes, sys, threading
if sys.argv[1] == "limit":
    from encoder_svc.memory_return import limit_malloc_arenas
    assert limit_malloc_arenas(2)
held, ready, go = [], threading.Barrier(9), threading.Event()
def work():
    held.append(bytearray(1 << 16))  # this thread's first malloc: an arena of its own, if glibc may
    ready.wait()
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
ready.wait()  # all eight alive and allocated at once
ctypes.CDLL("libc.so.6").malloc_stats()  # per arena, on stderr
go.set()
"""


def _arenas(mode: str) -> int:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    run = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return sum(line.startswith("Arena ") for line in run.stderr.splitlines())


def test_the_encoders_arena_limit_keeps_threads_to_two_arenas() -> None:
    # Eight threads allocating at once: an arena each (and main's) by glibc's default; two with the limit
    # the encoder sets at start, so that a trim gives back what a burst's threads freed.
    assert _arenas("default") > 2
    assert _arenas("limit") == 2


def test_a_burst_of_heavy_encodes_is_followed_by_a_trim_and_a_collection() -> None:
    import asyncio

    from common.memory_return import MemoryReturn

    trims: list[int] = []
    counted = memory_return.EncodeBytes(MemoryReturn(delay_s=0.0, trim=lambda: trims.append(1) or True))

    async def encode(nbytes: int, gate: asyncio.Event) -> None:
        with counted.holding(nbytes):
            await gate.wait()

    async def burst(sizes: list[int]) -> None:
        gate = asyncio.Event()
        tasks = [asyncio.create_task(encode(n, gate)) for n in sizes]
        await asyncio.sleep(0)
        assert counted.heavy_open == sum(n >= memory_return.HEAVY_ENCODE_BYTES for n in sizes)
        gate.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.01)  # the scheduled trim's turn

    asyncio.run(burst([1000] * 20))  # small requests: nothing counted, nothing run
    assert (counted.memory.trims, counted.memory.since_trim, trims) == (0, 0, [])
    asyncio.run(burst([5_400_000] * 6))  # 32 MB of 1344x1344 PNGs: one trim after the last, collected
    assert counted.heavy_open == 0
    assert (counted.memory.trims, counted.memory.collections, len(trims)) == (1, 1, 1)


def test_the_servicers_encode_counts_its_request_bytes() -> None:
    import asyncio

    from common.pb import common_pb2, encoder_pb2
    from encoder_svc.server import EncoderServicer

    seen: list[int] = []

    class _Servicer:
        encode_bytes = memory_return.EncodeBytes()

        async def _encode(self, request, context):
            seen.append(self.encode_bytes.heavy_open)
            return "answer"

    request = encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=bytes(100_000))])
    servicer = _Servicer()
    assert asyncio.run(EncoderServicer.Encode(servicer, request, None)) == "answer"
    assert seen == [1] and servicer.encode_bytes.heavy_open == 0
    assert servicer.encode_bytes.memory.since_trim == request.ByteSize()
