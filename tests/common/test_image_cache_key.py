"""Cache correctness of image keys: every processor setting of a checkpoint (mean, std, rescale factor,
resample, normalise and RGB flags, resize and crop rules, each family's own) is part of the key an image's
embedding is cached under, for every family and on both services, so two checkpoints whose settings give
different pixels never share an entry; identical settings give the same key."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from common.checkpoint import model_fingerprint
from common.families import family_of_model
from common.hashing import hash_image_file
from common.image_geometry import PER_IMAGE_DEFAULTS, hash_fingerprint
from common.model_maker import make_model
from common.processor_settings import PROCESSOR_FILES

PRESETS = ["tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny", "gemma-3-tiny", "phi-4-mm-tiny"]


@pytest.fixture(scope="module", params=PRESETS)
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint of each family."""
    out = tmp_path_factory.mktemp("keys") / request.param
    return make_model(request.param, out, seed=0, device="cpu", progress=False)


def _processor_file(model_dir: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(path, whole file, the image processor's settings inside it) of the checkpoint's image processor."""
    for name in PROCESSOR_FILES:
        path = model_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            nested = data.get("image_processor")
            if name == "processor_config.json" and isinstance(nested, dict):
                return path, data, nested
            if name == "preprocessor_config.json":
                return path, data, data
    raise AssertionError(f"{model_dir} has no image processor config")


def _variant(base: Path, out: Path, **settings: Any) -> Path:
    """A copy of base whose image processor settings are changed (a key set to None is removed)."""
    shutil.copytree(base, out)
    path, data, image_processor = _processor_file(out)
    for key, value in settings.items():
        if value is None:
            image_processor.pop(key, None)
        else:
            image_processor[key] = value
    path.write_text(json.dumps(data, indent=2))
    return out


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _decoder_key(model_dir: Path) -> str:
    """The content hash the decoder's input processor gives an image file."""
    from decoder_svc.engine import EngineConfig
    from decoder_svc.engine.input_processor import InputProcessor

    config = EngineConfig(model=model_dir, num_kv_blocks=8)
    inputs = InputProcessor.for_model(config, kv_capacity_tokens=1 << 16)
    marker = inputs.layout.generic_image_text(inputs.tokenizer.image_token) or "<image>"
    return inputs.make_request("r", marker, [_png()]).images[0].content_hash


def _encoder_key(model_dir: Path) -> str:
    """The content hash the encoder service gives the same file (encoder_svc/server.py's `_fingerprint`
    for an ImageInput without options)."""
    vision = family_of_model(model_dir).make_vision_encoder(model_dir)
    return hash_image_file(_png(), hash_fingerprint(vision.fingerprint, vision.image_settings()), "")


def test_image_mean_and_resample_change_both_services_keys(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint differing only in image_mean, or only in resample, gets other keys on the decoder and
    the encoder; an identical copy gets the same; the two services always agree."""
    _, _, settings = _processor_file(checkpoint)
    mean = [round(0.25 + 0.1 * c, 3) for c in range(3)]
    assert mean != settings.get("image_mean")
    resample = 2 if settings.get("resample", 3) != 2 else 3
    dirs = {"copy": _variant(checkpoint, tmp_path / "copy"),
            "mean": _variant(checkpoint, tmp_path / "mean", image_mean=mean),
            "resample": _variant(checkpoint, tmp_path / "resample", resample=resample)}
    base = _decoder_key(checkpoint)
    keys = {name: _decoder_key(d) for name, d in dirs.items()}
    assert keys["copy"] == base
    assert keys["mean"] != base and keys["resample"] != base and keys["mean"] != keys["resample"]
    for name, d in dirs.items():
        assert _encoder_key(d) == keys[name], name


def _leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _altered(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return "set" if value is None else None


def _set(data: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _settings_only(src: Path, out: Path) -> Path:
    """config.json and the processor configs of src (what the fingerprint reads besides weights)."""
    out.mkdir()
    for name in ("config.json", *PROCESSOR_FILES):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def test_every_processor_setting_is_in_the_fingerprint(checkpoint: Path, tmp_path: Path) -> None:
    """Field by field over the checkpoint's processor configs, nested ones included: each changed value is
    another model fingerprint, so no setting (one added later included) is left out of the image key.
    Only the per-image defaults are left out (each image's key records its choice), and the same settings
    written in another order or indentation are the same fingerprint."""
    base_dir = _settings_only(checkpoint, tmp_path / "base")
    base = model_fingerprint(base_dir)
    seen = {base}
    changed = 0
    for name in PROCESSOR_FILES:
        if not (base_dir / name).is_file():
            continue
        original = json.loads((base_dir / name).read_text())
        for path, value in _leaves(original):
            data = json.loads(json.dumps(original))
            _set(data, path, _altered(value))
            (base_dir / name).write_text(json.dumps(data))
            key = model_fingerprint(base_dir)
            if path[-1] in PER_IMAGE_DEFAULTS:
                assert key == base, (name, path)
            else:
                assert key not in seen, (name, path)
                seen.add(key)
                changed += 1
        (base_dir / name).write_text(json.dumps(original, indent=1, sort_keys=True))
        assert model_fingerprint(base_dir) == base
    assert changed >= 8  # mean and std (3 each), rescale factor, resample at least


def test_the_per_image_default_is_left_out(checkpoint: Path, tmp_path: Path) -> None:
    """do_pan_and_scan only picks the crop choice of images that name none, which each image's key
    records: adding it changes no fingerprint; removing a real setting does."""
    base = model_fingerprint(checkpoint)
    assert "do_pan_and_scan" in PER_IMAGE_DEFAULTS
    with_default = _variant(checkpoint, tmp_path / "pas", do_pan_and_scan=False)
    assert model_fingerprint(with_default) == base
    assert model_fingerprint(_variant(checkpoint, tmp_path / "no-std", image_std=None)) != base
