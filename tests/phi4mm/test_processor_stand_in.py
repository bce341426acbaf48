"""The family's reproduction of HF's Phi-4 image processor (`ModelFamily.processor_stand_in`): where HF's
cannot load (no torchvision here), benchmarks' HF references get it, and it gives what the CPU oracle
feeds HF's model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.families.phi4mm.layout import Phi4ImageLayout
from common.families.phi4mm.oracle import Phi4ProcessorReproduction
from common.families.phi4mm.pixels import batch_pixels, hd_transform
from common.families.registry import family_of_model
from tests.oracle import make_image


def test_the_family_declares_its_processor_reproduction(phi4_tiny_dir):
    stand_in = family_of_model(phi4_tiny_dir).image_processor_stand_in(phi4_tiny_dir)
    assert isinstance(stand_in, Phi4ProcessorReproduction)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="HF's own processor loads where torchvision is installed")
def test_benchmarks_get_it_where_hf_processor_cannot_load(phi4_tiny_dir):
    from bench.hf_ref import hf_image_processor
    from common.checkpoint import load_config

    processor = hf_image_processor(phi4_tiny_dir)
    assert isinstance(processor, Phi4ProcessorReproduction)
    images = [make_image(5, (97, 61)), make_image(6, (40, 130))]
    settings = Phi4ImageLayout.from_checkpoint(phi4_tiny_dir, load_config(phi4_tiny_dir)).settings
    want = batch_pixels([hd_transform(im, settings) for im in images])
    got = processor(images=images, return_tensors="pt")
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key


def test_a_family_without_one_says_so(tiny_model_dir):
    with pytest.raises(ValueError, match="the llava family has no stand-in"):
        family_of_model(tiny_model_dir).image_processor_stand_in(tiny_model_dir)
