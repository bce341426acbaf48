"""Decoder memory after heavy image requests (issue 32, CPU, tiny model): sixteen all-black 4096x4096
PNGs per request decode to 48 MiB each, but the decoder decodes and hashes one image at a time, keeps
only the encoded bytes, and hands freed memory back to the system when a request ends, so the requests
leave no gigabytes held behind them.

    PYTHONPATH=. python -m pytest -s tests/integration/test_decoder_memory.py    # prints the figures
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from PIL import Image

from common.images import encode_png
from tests.integration.harness import Pair

CLIENTS, ROUNDS, IMAGES_PER_REQUEST, SIDE = 2, 3, 16, 4096
PROMPT = "USER: " + "<image>" * IMAGES_PER_REQUEST + "\nWhat is in these pictures? ASSISTANT:"


def _mib(pid: int, field: str) -> float:
    """A field of /proc/PID/status (VmRSS: resident now; VmHWM: the peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def test_heavy_image_requests_leave_no_gigabytes_held(tiny_model_dir, tmp_path):
    black = encode_png(Image.new("RGB", (SIDE, SIDE)))  # about 50 kB: cheap to send, 48 MiB decoded
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--num-kv-blocks", "512"]).start()
    try:
        pid = pair.decoder.proc.pid
        with pair.decoder_client(timeout=300) as client:
            client.generate_text("USER: hi ASSISTANT:", max_tokens=2)  # warm: a text request
            client.generate_text("USER: <image>\nhi ASSISTANT:", [black], max_tokens=1)  # and one image
        before = _mib(pid, "VmRSS")
        finished: list[str] = []

        def heavy() -> None:
            with pair.decoder_client(timeout=300) as c:
                for _ in range(ROUNDS):
                    finished.append(c.generate_text(PROMPT, [black] * IMAGES_PER_REQUEST,
                                                    max_tokens=1).finish_reason)

        threads = [threading.Thread(target=heavy) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        time.sleep(1.0)  # the request's last references (gRPC buffers, the engine's) go
        after, peak = _mib(pid, "VmRSS"), _mib(pid, "VmHWM")
        print(f"\ndecoder RSS around {CLIENTS} clients x {ROUNDS} requests x {IMAGES_PER_REQUEST} "
              f"all-black {SIDE}x{SIDE} PNGs ({len(black)} bytes each): before {before:.0f} MiB, "
              f"peak {peak:.0f} MiB, after {after:.0f} MiB (held: {after - before:+.0f} MiB)")
        assert finished == ["LENGTH"] * (CLIENTS * ROUNDS), finished
        assert after - before < 64, (before, peak, after)  # was +393 MiB; +106 MiB without the trim
    finally:
        pair.stop()
