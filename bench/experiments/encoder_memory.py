"""The encoder's resident memory after large images: with and without giving freed memory back.

    python -m bench.experiments.encoder_memory            (qwen2.5-vl-tiny, CPU, 3 all-black 2048x2048 PNGs)
    python -m bench.experiments.encoder_memory --no-trim  (the same with malloc_trim disabled)

An in-process encoder (tests/encoder/conftest.py's harness: a real gRPC server on 127.0.0.1) without
decode processes, as on a host of fewer than 4 cores; each image is sent under its own cache_salt, so
every one is decoded, prepared and run through the tower. Prints VmRSS before and 1 s after.
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

from PIL import Image


def rss_mib() -> int:
    """This process's resident set, MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/mmserve-bench-qwen2.5-vl-tiny")
    parser.add_argument("--side", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--no-trim", action="store_true", help="disable giving freed memory back")
    args = parser.parse_args()
    if args.no_trim:
        from encoder_svc import memory_return

        memory_return.release_freed_memory = lambda: False
    model = Path(args.model)
    if not (model / "mmserve_model.json").exists():
        from common.model_maker import make_model

        make_model("qwen2.5-vl-tiny", model, seed=0, device="cpu", progress=False)
    from common.images import ImageLimits
    from common.pb import common_pb2, encoder_pb2
    from encoder_svc.config import EncoderConfig
    from tests.encoder.conftest import EncoderHarness

    harness = EncoderHarness(EncoderConfig(model=str(model), cache_bytes=256 << 20, lease_ttl_s=30,
                                           decode_processes=0, limits=ImageLimits(max_side=8192)))
    buf = io.BytesIO()
    Image.new("RGB", (args.side, args.side)).save(buf, "PNG")
    before = rss_mib()
    for i in range(args.requests):
        harness.stub.Encode(encoder_pb2.EncodeRequest(
            images=[common_pb2.ImageInput(data=buf.getvalue(), max_pixels=args.side * args.side)],
            accept=[common_pb2.TRANSPORT_INLINE], cache_salt=f"s{i}"), timeout=600)
    time.sleep(1.0)  # the tower thread trims after it has answered: let it
    print(f"{'no trim' if args.no_trim else 'trim'}: VmRSS {before} MiB before, {rss_mib()} MiB 1 s after "
          f"{args.requests} Encodes of a {args.side}x{args.side} PNG")
    harness.close()


if __name__ == "__main__":
    main()
