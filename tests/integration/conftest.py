"""Fixtures: a running encoder+decoder pair on the tiny checkpoint, the HF oracle, test images."""

from __future__ import annotations

import pytest
from PIL import Image

from common.families.llava.oracle import LlavaOracle
from common.images import encode_png
from tests.integration.harness import Pair
from tests.oracle import make_image

png = encode_png


@pytest.fixture(scope="session")
def oracle(tiny_model_dir) -> LlavaOracle:
    return LlavaOracle(tiny_model_dir)


@pytest.fixture(scope="session")
def test_images() -> list[Image.Image]:
    sizes = [(11, (40, 52)), (12, (28, 28)), (13, (64, 30)), (14, (33, 47))]
    return [make_image(s, size) for s, size in sizes]


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """The default pair: lookahead on, small KV pool, shared-memory handoff."""
    p = Pair(tiny_model_dir, tmp_path_factory.mktemp("pair"),
             decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "64",
                           "--encoder-timeout", "5"]).start()
    yield p
    p.stop()
