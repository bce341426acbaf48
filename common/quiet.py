"""Silencing transformers' advice that does not apply to us while the model maker writes a checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def transformers_errors_only() -> Iterator[None]:
    """transformers' log at ERROR for the duration: the model maker saves HF image processors, and
    transformers suggests torchvision for them, which mmserve does not use (it has its own pixel path)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
