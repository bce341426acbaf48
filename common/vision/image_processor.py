"""A checkpoint's Hugging Face image processor, loaded offline (LLaVA's encoder prepares with it; the
benchmarks' HF references load any family's with it)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def load_image_processor(model_dir: Path):
    """The checkpoint's image processor, offline; falls back to the full processor's."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # older layouts keep it only inside processor_config.json
        log.info("AutoImageProcessor failed (%s); using AutoProcessor's image_processor", exc)
        return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True).image_processor
