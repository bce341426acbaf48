"""gemma-3-tiny: a random checkpoint HF loads offline, with Gemma 3's architecture choices."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def test_loads_in_hf(gemma3_tiny_dir: Path) -> None:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration, Gemma3Processor

    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_tiny_dir, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(str(gemma3_tiny_dir), local_files_only=True)
    assert isinstance(processor, Gemma3Processor)
    config = model.config
    assert processor.image_seq_length == config.mm_tokens_per_image == 16
    tok = processor.tokenizer
    assert tok.image_token_id == config.image_token_index
    assert tok.convert_tokens_to_ids(tok.boi_token) == config.boi_token_index
    assert tok.convert_tokens_to_ids(tok.eoi_token) == config.eoi_token_index
    assert len(tok) == config.text_config.vocab_size
    assert set(config.text_config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.vision_config.vision_use_head is False
    # Not the zero init HF would give (a (1 + w) norm at 0 and a zero projection): weights were drawn.
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    assert proj.abs().mean() > 0.05


def test_metadata(gemma3_tiny_dir: Path) -> None:
    meta = json.loads((gemma3_tiny_dir / "mmserve_model.json").read_text())
    assert meta["preset"] == "gemma-3-tiny" and meta["copies"] == "google/gemma-3-4b-it"


def test_features_vary(gemma3_tiny_dir: Path, gemma3_oracle) -> None:
    """Random features that differ from image to image and row to row (not degenerate)."""
    from tests.gemma3.conftest import sample_images

    feats = gemma3_oracle.image_features(gemma3_oracle.pixels(sample_images()[:2]))
    assert feats.shape == (2, 16, 64)
    assert (feats[0] - feats[1]).abs().mean() > 0.1
    assert feats[0].std(dim=0).mean() > 0.1
