"""The processor settings of a checkpoint, as the model fingerprint hashes them.

An image's pixels (and so its embedding) follow the checkpoint's processor configs as much as its
config.json and weights: mean, std, rescale factor, resample filter, resize and crop rules, RGB
conversion, and each family's own settings (Gemma 3's crop rule, Phi-4-MM's dynamic_hd, LLaVA's feature
select strategy). Every setting of those files goes into the fingerprint, whatever the family and
whether or not a reader here knows its name, so a setting added later cannot be left out of the image
cache key. Only the per-image defaults (common/image_geometry.PER_IMAGE_DEFAULTS) are left out: each
image's own key records the choice they make, so checkpoints that only default differently share
entries for the images that choose alike.

The files are read as JSON and written back canonically (sorted keys, no spaces): the same settings
saved in another order or indentation are the same fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.image_geometry import PER_IMAGE_DEFAULTS

# Where transformers keeps an image processor's settings: its own file (older saves, Qwen-VL), or nested
# under "image_processor" in the processor's (transformers 5), beside the processor's own settings.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_NESTED = "image_processor"


def _without_per_image_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in settings.items() if k not in PER_IMAGE_DEFAULTS}
    if isinstance(out.get(_NESTED), dict):
        out[_NESTED] = _without_per_image_defaults(out[_NESTED])
    return out


def processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """{file name: its settings less the per-image defaults} of the checkpoint's processor configs that
    exist; a file that is not a JSON object is kept as its text (hashed, never interpreted)."""
    out: dict[str, Any] = {}
    for name in PROCESSOR_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        text = path.read_text()
        try:
            settings = json.loads(text)
        except ValueError:
            settings = None
        out[name] = _without_per_image_defaults(settings) if isinstance(settings, dict) else text
    return out


def processor_settings_bytes(model_dir: str | Path) -> bytes:
    """processor_settings as canonical JSON: what the model fingerprint hashes."""
    return json.dumps(processor_settings(model_dir), sort_keys=True, separators=(",", ":")).encode()
