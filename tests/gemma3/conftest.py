"""The gemma-3-tiny checkpoints, made once per session (by Gemma 3's maker directly: the pan-and-scan one
takes a maker option common.model_maker.make_model does not pass)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from common.families.gemma3.layout import PanAndScan
from common.families.gemma3.maker import make_gemma3_model
from tests.family_fixtures import made_checkpoint


def _tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, **maker_options) -> Path:
    """gemma-3-tiny (seed 0) made once by Gemma 3's maker (whose options make_model does not take) as
    `name`."""
    return made_checkpoint(tmp_path_factory, "gemma-3-tiny", 0, name=name, maker=make_gemma3_model,
                           **maker_options)


@pytest.fixture(scope="session")
def gemma3_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random gemma-3-tiny checkpoint (fp32, 224 px, 16 image tokens)."""
    return _tiny_checkpoint(tmp_path_factory, "gemma-3-tiny-seed0")


# Crops from 32 px: the sample images (a few hundred px) activate pan-and-scan; 1.2 and 4 are HF's.
TINY_PAN_AND_SCAN = PanAndScan(min_crop_size=32, max_num_crops=4, min_ratio_to_activate=1.2)


@pytest.fixture(scope="session")
def gemma3_pas_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma-3-tiny (the same weights and config.json) with pan-and-scan on in its image processor config."""
    return _tiny_checkpoint(tmp_path_factory, "gemma-3-tiny-pas-seed0", pan_and_scan=TINY_PAN_AND_SCAN)


@pytest.fixture(scope="session")
def gemma3_pas_off_dir(gemma3_pas_dir: Path) -> Path:
    """gemma3_pas_dir (the same weights and crop rule) with do_pan_and_scan false in its image processor
    config: crops only where a request turns them on (ImageInput.pan_and_scan)."""
    out = gemma3_pas_dir.parent / (gemma3_pas_dir.name + "-off")
    if not (out / "mmserve_model.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(gemma3_pas_dir, tmp)
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = tmp / name
            if path.is_file():
                config = json.loads(path.read_text())
                target = config.get("image_processor", config) if name == "processor_config.json" else config
                if "do_pan_and_scan" in target:
                    target["do_pan_and_scan"] = False
                path.write_text(json.dumps(config, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def gemma3_pas_oracle(gemma3_pas_dir: Path):
    """HF's Gemma3ForConditionalGeneration and Gemma3Processor (crops on) on the pan-and-scan checkpoint."""
    from common.families.gemma3.oracle import Gemma3Oracle

    return Gemma3Oracle(gemma3_pas_dir)


@pytest.fixture(scope="session")
def gemma3_oracle(gemma3_tiny_dir: Path):
    """HF's Gemma3ForConditionalGeneration on the tiny checkpoint."""
    from common.families.gemma3.oracle import Gemma3Oracle

    return Gemma3Oracle(gemma3_tiny_dir)


def sample_images() -> list[Image.Image]:
    """Images of different sizes and aspects (landscape, portrait, square, a thin strip), not uniform."""
    sizes = [(300, 200), (97, 150), (224, 224), (1000, 50)]
    return [Image.effect_noise(size, 40 + 10 * i).convert("RGB") for i, size in enumerate(sizes)]
