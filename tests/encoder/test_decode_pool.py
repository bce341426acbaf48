"""The decode pool (encoder_svc/decode_pool.py): the same hash and pixels as the thread path and as
`hash_image_file`, bad images failing alone, and a dead worker process failing its images, not hanging
them."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.hashing import hash_image_file
from common.images import ImageError, ImageLimits, decode_image
from encoder_svc import decode_child, decode_pool
from encoder_svc.decode_pool import DecodePool, DecodeWorkerDied
from encoder_svc.decoded_image import DecodedImage, decode_and_hash
from tests.encoder.conftest import image_bytes

FINGERPRINT = "test-model"
HANG_GUARD_S = 120  # a generous bound that only a hang reaches


def _file(mode: str, fmt: str, seed: int = 0, size: tuple[int, int] = (37, 23)) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


FILES = {
    "png-rgb": _file("RGB", "PNG"),
    "png-rgba": _file("RGBA", "PNG", seed=1),
    "png-gray": _file("L", "PNG", seed=2),
    "jpeg": _file("RGB", "JPEG", seed=3),
    "gif": _file("RGB", "GIF", seed=4),
}


@pytest.fixture(scope="module")
def pool():
    p = DecodePool(2)
    p.start()
    yield p
    p.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


@pytest.mark.parametrize("name", sorted(FILES))
def test_hash_and_pixels_match_hash_image_file(name):
    data = FILES[name]
    reference = decode_image(data)
    decoded = decode_and_hash(data, ImageLimits(), FINGERPRINT, "salt-a")
    assert decoded.content_hash == hash_image_file(data, FINGERPRINT, "salt-a")
    assert decoded.content_hash != decode_and_hash(data, ImageLimits(), FINGERPRINT, "salt-b").content_hash
    assert (decoded.width, decoded.height) == reference.size
    assert decoded.pixels == reference.tobytes()
    assert decoded.to_pil().tobytes() == reference.tobytes() and decoded.to_pil().mode == "RGB"
    np.testing.assert_array_equal(decoded.array(), np.asarray(reference))


def test_pool_gives_what_the_thread_path_gives(pool):
    async def both():
        return await asyncio.gather(*(pool.decode(d, FINGERPRINT, "s") for d in FILES.values()))

    for data, from_pool in zip(FILES.values(), run(both()), strict=True):
        assert isinstance(from_pool, DecodedImage)
        assert from_pool == decode_and_hash(data, ImageLimits(), FINGERPRINT, "s")


def test_bad_image_fails_alone_with_the_thread_paths_message(pool):
    bad = image_bytes(5)[:60]  # a truncated PNG
    with pytest.raises(ImageError) as in_thread:
        decode_and_hash(bad, ImageLimits(), FINGERPRINT, "")

    async def mixed():
        return await asyncio.gather(pool.decode(bad, FINGERPRINT, ""),
                                    pool.decode(FILES["jpeg"], FINGERPRINT, ""), return_exceptions=True)

    failed, good = run(mixed())
    assert isinstance(failed, ImageError) and str(failed) == str(in_thread.value)
    assert good == decode_and_hash(FILES["jpeg"], ImageLimits(), FINGERPRINT, "")


def test_pool_applies_its_limits():
    small = DecodePool(1, ImageLimits(max_side=16))
    try:
        with pytest.raises(ImageError, match="maximum side of 16"):
            run(small.decode(FILES["png-rgb"], FINGERPRINT, ""))
    finally:
        small.close()


def test_a_dying_worker_fails_its_images_and_the_pool_recovers():
    pool = DecodePool(2)
    try:
        pool.start()

        async def crash_among_others():
            others = [pool.decode(d, FINGERPRINT, "") for d in FILES.values()]
            return await asyncio.gather(pool.run(os._exit, 3), *others, return_exceptions=True)

        crashed, *others = run(crash_among_others())
        assert isinstance(crashed, DecodeWorkerDied)
        # Images in flight with it are retried on the other process: none hangs, none is wrong.
        for data, got in zip(FILES.values(), others, strict=True):
            assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")
        assert pool.restarts == 1 and len(pool.pids) == 2
        after = run(pool.decode(FILES["png-rgb"], FINGERPRINT, ""))
        assert after == decode_and_hash(FILES["png-rgb"], ImageLimits(), FINGERPRINT, "")
        assert sorted(pool._free) == list(range(pool.slots))
    finally:
        pool.close()


def _crash_on_decode(conn, parent, limits):
    """A decode process whose every image decode kills it (as a crash in a decoder library would)."""
    monkey = pytest.MonkeyPatch()
    monkey.setattr(decode_child, "decode_in_slot", _crash)
    decode_child.child_main(conn, parent, limits)


class _Poisoned(DecodePool):
    child_main = staticmethod(_crash_on_decode)


def test_an_image_that_kills_two_processes_fails_and_is_not_retried_again():
    pool = _Poisoned(2)
    try:
        pool.start()

        async def poison():
            return await pool.decode(FILES["png-rgb"], FINGERPRINT, "")

        with pytest.raises(DecodeWorkerDied, match="died while decoding this image"):
            run(poison())
        assert pool.restarts == 2  # tried once more, never a third time
        assert sorted(pool._free) == list(range(pool.slots))
        assert run(pool.run(os.getpid)) in pool.pids  # the replacements serve on
    finally:
        pool.close()


def _crash(*args):
    os._exit(9)


def test_a_worker_killed_while_idle_costs_no_request():
    pool = DecodePool(1)
    try:
        pool.start()
        old = pool.pids

        async def kill_then_decode():
            await pool.run(os.getpid)  # the pool is read on this loop
            os.kill(old[0], signal.SIGKILL)
            deadline = time.monotonic() + HANG_GUARD_S
            while pool.restarts == 0:  # its closed socket is noticed on the loop
                assert time.monotonic() < deadline, "the pool never noticed its dead process"
                await asyncio.sleep(0.05)
            return await pool.decode(FILES["gif"], FINGERPRINT, "")

        got = run(kill_then_decode())
        assert got == decode_and_hash(FILES["gif"], ImageLimits(), FINGERPRINT, "")
        assert pool.restarts == 1 and pool.pids != old
    finally:
        pool.close()


def test_a_worker_killed_with_an_image_in_flight_is_retried_elsewhere():
    pool = DecodePool(2)
    try:
        pool.start()

        async def kill_one_mid_decode():
            slow = asyncio.ensure_future(pool.run(time.sleep, 30))  # holds one process
            await asyncio.sleep(0.2)
            busy = next(c for c in pool._children if c.jobs)
            image = asyncio.ensure_future(pool.decode(FILES["jpeg"], FINGERPRINT, ""))
            await asyncio.sleep(0)
            # Send the image to the busy process too, then kill it: the image must come back anyway.
            os.kill(busy.process.pid, signal.SIGKILL)
            got = await image
            with pytest.raises(DecodeWorkerDied):  # run() jobs are not retried
                await slow
            return got

        assert run(kill_one_mid_decode()) == decode_and_hash(FILES["jpeg"], ImageLimits(), FINGERPRINT, "")
        assert pool.restarts == 1
    finally:
        pool.close()


def test_a_closed_pool_refuses_work():
    pool = DecodePool(1)
    pool.start()
    pool.close()
    with pytest.raises(DecodeWorkerDied, match="closed"):
        run(pool.decode(FILES["gif"], FINGERPRINT, ""))


def test_pool_needs_a_process():
    with pytest.raises(ValueError, match="at least one process"):
        DecodePool(0)


def _distinct_files(n: int) -> list[bytes]:
    return [_file("RGB", "PNG", seed=50 + i, size=(20 + i, 17 + 2 * i)) for i in range(n)]


def test_images_wait_for_a_slot_and_slots_are_reused_after_their_pixels_were_copied_out():
    files = _distinct_files(24)
    pool = DecodePool(2, slots=2)  # far fewer slots than images in flight
    try:
        assert pool.segment is not None, "this test needs /dev/shm"

        async def all_at_once():
            return await asyncio.gather(*(pool.decode(d, FINGERPRINT, "") for d in files))

        for data, got in zip(files, run(all_at_once()), strict=True):
            assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")
        assert sorted(pool._free) == [0, 1]
    finally:
        pool.close()


def _solid_png(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("data", "kw"), [
    (_solid_png(200), dict(slot_bytes=4096)),  # a small file, 120 kB of pixels: back in the reply
    (_solid_png(1000), dict(slot_bytes=32768)),  # 3 MB of pixels: a reply the loop reads in pieces
    (FILES["png-rgb"], dict(slot_bytes=1000)),  # a file larger than a slot: decoded in a thread
    (FILES["png-rgb"], dict(slots=0)),  # no slots at all: threads
], ids=["pixels-larger-than-slot", "pixels-in-several-reads", "file-larger-than-slot", "no-slots"])
def test_images_that_do_not_fit_a_slot(data, kw):
    pool = DecodePool(1, **kw)
    try:
        assert len(data) < 32768 and 4096 < 3 * 200 * 200
        got = run(pool.decode(data, FINGERPRINT, ""))
        assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")
        assert sorted(pool._free) == list(range(len(pool._free)))
    finally:
        pool.close()


def test_a_cancelled_decode_frees_its_slot_once_the_child_is_done():
    files = _distinct_files(6)
    pool = DecodePool(1, slots=3)
    try:
        async def cancel_some():
            tasks = [asyncio.ensure_future(pool.decode(d, FINGERPRINT, "")) for d in files]
            await asyncio.sleep(0)  # submitted
            for t in tasks[:3]:
                t.cancel()
            return await asyncio.gather(*tasks[3:])

        for data, got in zip(files[3:], run(cancel_some()), strict=True):
            assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")
        deadline = time.monotonic() + HANG_GUARD_S
        while len(pool._free) < 3:  # the cancelled ones' children finish in their own time
            assert time.monotonic() < deadline, "a cancelled decode never gave its slot back"
            time.sleep(0.05)
        assert sorted(pool._free) == [0, 1, 2]
    finally:
        pool.close()


@pytest.mark.parametrize(("cores", "expected"), [(1, 0), (2, 0), (3, 0), (4, 3), (9, 8), (64, 8)])
def test_default_decode_processes(monkeypatch, cores, expected):
    from encoder_svc import defaults

    monkeypatch.setattr(defaults.os, "sched_getaffinity", lambda _: set(range(cores)), raising=False)
    assert defaults.default_decode_processes() == expected


_ORPHAN_SCRIPT = """
import os
from encoder_svc.decode_pool import DecodePool
if __name__ == "__main__":
    pool = DecodePool(2)
    pool.start()
    print(pool.segment.path, flush=True)
    print(" ".join(str(p) for p in pool.pids), flush=True)
    os.kill(os.getpid(), 9)  # as the OOM killer would: no shutdown of the pool
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL and /proc")
def test_decode_processes_exit_when_the_server_is_killed(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    segment, pids = proc.stdout.splitlines()
    Path(segment).unlink(missing_ok=True)  # its owner died: what the next encoder's sweep would do
    children = [int(p) for p in pids.split()]
    assert len(children) == 2
    deadline = time.monotonic() + HANG_GUARD_S
    while any(Path(f"/proc/{pid}").exists() and "spawn_main" in _cmdline(pid) for pid in children):
        assert time.monotonic() < deadline, "decode processes outlived their server"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_pixels_left_in_their_slot_hold_it_until_released():
    pool = DecodePool(1, slots=2)
    try:
        async def both():
            return await asyncio.gather(*(pool.decode(d, FINGERPRINT, "", in_slot=True)
                                          for d in (FILES["png-rgb"], FILES["jpeg"])))

        first, second = run(both())
        for data, got in ((FILES["png-rgb"], first), (FILES["jpeg"], second)):
            assert isinstance(got.pixels, memoryview)
            assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")  # read in place
        assert pool._free == []  # both slots are held by the images
        first.release()
        first.release()  # a second release gives nothing back twice
        assert len(pool._free) == 1
        del second, got  # collected: its slot comes back too
        assert sorted(pool._free) == [0, 1]
    finally:
        pool.close()


def test_a_decode_waiting_for_a_slot_gets_one_released_from_another_thread():
    pool = DecodePool(1, slots=1)
    try:
        async def wait_for_slot():
            held = await pool.decode(FILES["png-rgb"], FINGERPRINT, "", in_slot=True)
            later = asyncio.ensure_future(pool.decode(FILES["gif"], FINGERPRINT, ""))
            await asyncio.sleep(0.2)
            assert not later.done()  # no slot free
            await asyncio.to_thread(held.release)  # as the vision worker's thread does
            return await later

        assert run(wait_for_slot()) == decode_and_hash(FILES["gif"], ImageLimits(), FINGERPRINT, "")
        assert pool._free == [0]
    finally:
        pool.close()


def _die_at_start(conn, parent, limits):
    os._exit(4)  # as a child whose imports fail would


class _NeverStarts(DecodePool):
    child_main = staticmethod(_die_at_start)


def test_processes_that_keep_dying_at_start_leave_decoding_to_threads():
    pool = _NeverStarts(2)
    try:
        pool.start(timeout_s=HANG_GUARD_S)  # returns: no endless respawning
        assert pool.disabled and pool.restarts <= 2
        got = run(pool.decode(FILES["png-rgb"], FINGERPRINT, "", in_slot=True))
        assert got == decode_and_hash(FILES["png-rgb"], ImageLimits(), FINGERPRINT, "")
        with pytest.raises(DecodeWorkerDied, match="could not start"):
            run(pool.run(os.getpid))
    finally:
        pool.close()


@pytest.mark.parametrize(("free_mib", "expected_mib"), [(4096, 8), (200, 2), (40, 1), (0, 1)])
def test_slots_are_as_large_as_shared_memory_allows(monkeypatch, free_mib, expected_mib):
    from common.transport import shm

    monkeypatch.setattr(shm, "shm_available", lambda: free_mib > 0)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: free_mib << 20)
    assert decode_pool._default_slot_bytes(32) == expected_mib << 20


def test_many_decodes_cancelled_and_released_at_random_leave_every_slot_free():
    import random

    files = _distinct_files(40)
    pool = DecodePool(2, slots=3)
    rng = random.Random(7)
    try:
        async def churn():
            async def one(data: bytes):
                in_slot = rng.random() < 0.5
                got = await pool.decode(data, FINGERPRINT, "", in_slot=in_slot)
                assert got == decode_and_hash(data, ImageLimits(), FINGERPRINT, "")
                if in_slot:  # released on the loop or from another thread, as the vision worker does
                    await (asyncio.to_thread(got.release) if rng.random() < 0.5 else asyncio.sleep(0))
                    got.release()
                return got.content_hash

            tasks = [asyncio.ensure_future(one(d)) for d in files]
            for _ in range(12):
                await asyncio.sleep(rng.random() * 0.02)
                rng.choice(tasks).cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            # A cancelled decode's slot comes back once its child replies, read on this loop.
            while sorted(pool._free) != [0, 1, 2]:
                await asyncio.sleep(0.05)
            return results

        results = run(churn())  # (a lost slot hangs it: run's guard fails the test)
        assert all(isinstance(r, (str, asyncio.CancelledError)) for r in results), results
        assert sum(isinstance(r, str) for r in results) >= len(files) - 12
        assert all(w.done() for w in pool._waiting)
    finally:
        pool.close()
