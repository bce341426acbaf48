"""Hostile input and faults against a real pair (CPU, tiny model); prints the figures RELIABILITY.md
quotes: RSS and open fds before and after, time to fail on an outage and a full cache, time to drain.

    python scripts/reliability_probe.py
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image  # noqa: E402

from common.client import DecoderClient, EncoderClient  # noqa: E402
from common.images import encode_png  # noqa: E402
from common.launcher import default_home  # noqa: E402
from common.model_maker import make_model  # noqa: E402
from tests.integration.harness import Pair  # noqa: E402
from tests.oracle import make_image  # noqa: E402

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def usage(pid: int) -> tuple[float, int]:
    """(RSS MiB, open fds) of a process."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def hostile(client: DecoderClient) -> dict[str, str]:
    big = encode_png(Image.new("RGB", (8192, 8192)))
    small = encode_png(make_image(1))
    cases = {
        "16 PNGs of 8192x8192 (3.1 MB)": dict(prompt="USER: " + "<image>" * 16, images=[big] * 16),
        "50 images": dict(prompt="USER: " + "<image>" * 50, images=[small] * 50),
        "10 MB prompt": dict(prompt="word " * 2_000_000),
        "temperature NaN": dict(prompt="USER: hi", temperature=math.nan),
        "temperature 1e-45": dict(prompt="USER: hi", temperature=1e-45),
        "role {{ 7*7 }}": dict(chat=[{"role": "{{ 7*7 }}", "content": [{"type": "text", "text": "hi"}]}]),
        "unknown content hash": dict(prompt=PROMPT, images=["hash:" + "ab" * 32]),
        "cache_salt of 1 MB": dict(prompt="USER: hi", cache_salt="s" * (1 << 20)),
    }
    out = {}
    for name, kw in cases.items():
        started = time.monotonic()
        try:
            client.generate_text(kw.pop("prompt", None), kw.pop("images", ()), max_tokens=2, **kw)
            out[name] = "OK"
        except grpc.RpcError as exc:
            out[name] = f"{exc.code().name} in {1e3 * (time.monotonic() - started):.0f} ms"
        except Exception as exc:  # noqa: BLE001 - a client-side refusal (e.g. message too large)
            out[name] = f"client: {type(exc).__name__}"
    return out


def main() -> int:
    model = default_home() / "models" / "tiny"
    if not (model / "mmserve_model.json").exists():
        make_model("tiny", model)
    tmp = Path(tempfile.mkdtemp())
    pair = Pair(model, tmp, decoder_args=["--encoder-timeout", "2", "--drain-timeout", "30"],
                encoder_args=["--cache-bytes", str(16 * 64 * 4)]).start()
    with DecoderClient(pair.decoder.address, timeout=60) as client:
        client.generate_text(PROMPT, [encode_png(make_image(2))], max_tokens=4)
        before = {"decoder": usage(pair.decoder.proc.pid), "encoder": usage(pair.encoder.proc.pid)}
        results = hostile(client)
        ok = client.generate_text(PROMPT, [encode_png(make_image(3))], max_tokens=4).finish_reason
        after = {"decoder": usage(pair.decoder.proc.pid), "encoder": usage(pair.encoder.proc.pid)}
        # A full cache of leased entries (one slot, held by another client).
        with EncoderClient(pair.encoder.address, timeout=30) as holder:
            ref = holder.encode([encode_png(make_image(4))], accept=(2,)).embeddings[0]
            started = time.monotonic()
            try:
                client.generate_text(PROMPT, [encode_png(make_image(5))], max_tokens=2)
            except grpc.RpcError as exc:
                results["full cache of leased entries"] = (f"{exc.code().name} in "
                                                           f"{time.monotonic() - started:.2f} s")
            holder.release([ref.lease_id])
    # Drain: SIGTERM during a 300-token stream.
    done: dict = {}

    def stream():
        with DecoderClient(pair.decoder.address, timeout=120) as c:
            done["tokens"] = len(c.generate_text("USER: go on ASSISTANT:", max_tokens=300, ignore_eos=True)
                                 .token_ids)
            done["at"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    sigterm = time.monotonic()
    pair.decoder.proc.send_signal(signal.SIGTERM)
    code = pair.decoder.proc.wait(60)
    exited = time.monotonic()
    t.join()
    # Outage: 12 image requests (more than the 8 fetch workers) against a SIGKILLed encoder.
    pair.decoder.start()
    pair.encoder.stop(sig=9)
    elapsed: list[float] = []

    def doomed(i):
        started = time.monotonic()
        with DecoderClient(pair.decoder.address, timeout=60) as c:
            try:
                c.generate_text(PROMPT, [encode_png(make_image(50 + i))], max_tokens=2)
            except grpc.RpcError:
                pass
        elapsed.append(time.monotonic() - started)

    threads = [threading.Thread(target=doomed, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pair.stop()
    print("| hostile request | answer |\n| --- | --- |")
    for name, result in results.items():
        print(f"| {name} | {result} |")
    print(f"\nnormal request right after: {ok}")
    for svc in ("decoder", "encoder"):
        (rss0, fd0), (rss1, fd1) = before[svc], after[svc]
        print(f"{svc}: RSS {rss0:.0f} -> {rss1:.0f} MiB, fds {fd0} -> {fd1}")
    print(f"drain: stream of {done.get('tokens')} tokens finished {done['at'] - sigterm:.2f} s after "
          f"SIGTERM; process exited {exited - sigterm:.2f} s after SIGTERM with code {code}")
    print(f"outage (--encoder-timeout 2): 12 requests failed in {min(elapsed):.2f}-{max(elapsed):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
