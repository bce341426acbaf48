"""bench/heavy_images.py on the tiny model (issue 32's workload, scaled down for CI): text completions
through the gateway while two clients send new large PNGs without pause. What must hold, with no clock
bound: every text request is answered (200), before the first heavy request is (each heavy request is
seconds of image decoding; the regression put text requests behind them), and the heavy requests are
answered 200 or pushed back with 429. The latencies are the benchmark's figures (RELIABILITY.md)."""

from __future__ import annotations

import pytest

from bench.heavy_images import build_arg_parser, numbered_png, run
from common.images import encode_png


@pytest.mark.slow  # starts an encoder, a decoder and a gateway
def test_text_requests_are_answered_before_the_heavy_image_requests(tiny_model_dir, tmp_path):
    args = build_arg_parser().parse_args([
        "--model", str(tiny_model_dir), "--images-per-request", "8", "--side", "4096", "--text-requests", "4",
        "--settle-s", "1.0", "--text-gap-s", "0.1", "--out", str(tmp_path / "heavy.json")])
    r = run(args)["results"]
    assert r["text_statuses"] == [200] * 4
    assert r["heavy_statuses"] and set(r["heavy_statuses"]) <= {200, 429}, r["heavy_statuses"]
    assert max(r["text_done_s"]) < min(r["heavy_done_s"]), (r["text_done_s"], r["heavy_done_s"])
    assert (tmp_path / "heavy.json").exists()


def test_each_numbered_png_is_a_new_file_of_the_same_pixels():
    from io import BytesIO

    from PIL import Image

    png = encode_png(Image.new("RGB", (8, 8), (1, 2, 3)))
    a, b = numbered_png(png, 1), numbered_png(png, 2)
    assert len({png, a, b}) == 3
    for data in (a, b):
        with Image.open(BytesIO(data)) as im:
            assert im.convert("RGB").tobytes() == Image.new("RGB", (8, 8), (1, 2, 3)).tobytes()
