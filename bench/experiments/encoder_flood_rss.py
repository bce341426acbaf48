"""The encoder's resident memory under a flood of distinct images: where it goes, and what comes back.

    python -m bench.experiments.encoder_flood_rss                      (as the encoder runs now)
    python -m bench.experiments.encoder_flood_rss --arenas 0 --no-burst-trim   (as it ran before)

An in-process encoder (tests/encoder/conftest.py's harness: a real gRPC server on 127.0.0.1) on
qwen2.5-vl-tiny (CPU), a 4 MiB cache as bench.chaos gives it; 12 small images to warm up, then --rounds
rounds of --flood distinct noise PNGs (--side pixels a side, as bench.chaos's flood) sent --concurrency
at a time, each under its own cache_salt. Prints, after warm-up and 1.5 s after each round: VmRSS and
glibc's own count (mallinfo2: heap, in use, free), then after a full collection, then after a
malloc_trim. --arenas N: glibc's arena limit set at start as the encoder's main does (0: glibc's default,
8 per core); --no-burst-trim: without the trim once a burst of Encodes ends.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks",
                                                      "keepcost")]


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def malloc_mib() -> str:
    """glibc's heap (all arenas), in use and free, MiB (free includes pages already given back)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return "(no mallinfo2)"
    return f"heap {m.arena >> 20}, in use {m.uordblks >> 20}, free {m.fordblks >> 20}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/mmserve-bench-qwen2.5-vl-tiny")
    parser.add_argument("--side", type=int, default=1344)
    parser.add_argument("--flood", type=int, default=20, help="distinct images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--arenas", type=int, default=None,
                        help="glibc's arena limit (default: the encoder's; 0: glibc's own)")
    parser.add_argument("--no-burst-trim", action="store_true")
    args = parser.parse_args()
    from encoder_svc import memory_return

    if args.arenas != 0:
        memory_return.limit_malloc_arenas(args.arenas or memory_return.MALLOC_ARENAS)
    model = Path(args.model)
    if not (model / "mmserve_model.json").exists():
        from common.model_maker import make_model

        make_model("qwen2.5-vl-tiny", model, seed=0, device="cpu", progress=False)
    from bench.soak import noise_image
    from common.freed_memory import release_freed_memory
    from common.pb import common_pb2, encoder_pb2
    from encoder_svc.config import EncoderConfig
    from tests.encoder.conftest import EncoderHarness

    harness = EncoderHarness(EncoderConfig(model=str(model), cache_bytes=4 << 20, lease_ttl_s=10))
    if args.no_burst_trim:
        harness.servicer.encode_bytes.memory.trim = lambda: False

    def encode(image: bytes, salt: str) -> None:
        harness.stub.Encode(encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=image)],
                                                      accept=[common_pb2.TRANSPORT_INLINE], cache_salt=salt),
                            timeout=600)

    def report(what: str) -> None:
        print(f"{what:26s} VmRSS {rss_mib():5d} MiB; malloc (MiB): {malloc_mib()}", flush=True)

    for i in range(12):
        side = (56, 84, 112)[i % 3]
        encode(noise_image(i, side, side), f"warm{i}")
    time.sleep(1.5)
    report("after warm-up")
    seed = 1000
    for r in range(args.rounds):
        images = [noise_image(seed + i, args.side, args.side) for i in range(args.flood)]
        seed += args.flood
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda item: encode(*item), [(im, f"f{r}-{j}") for j, im in enumerate(images)]))
        del images
        time.sleep(1.5)  # a burst's trim comes a second after its last Encode
        report(f"after flood round {r}")
    gc.collect()
    report("then collected")
    release_freed_memory()
    report("then trimmed")
    memory = harness.servicer.encode_bytes.memory
    print(f"burst trims {memory.trims}, collections {memory.collections}")
    harness.close()


if __name__ == "__main__":
    main()
