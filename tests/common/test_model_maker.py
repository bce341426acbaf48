"""The tiny preset loads through transformers and generates varied text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from common.checkpoint import model_fingerprint


def test_tiny_loads_with_hf_and_generates_varied_tokens(tiny_model_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    inputs = processor(text="USER: <image>\nWhat is this? ASSISTANT:", images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert int((ids == config["image_token_index"]).sum()) == config["image_seq_length"] == 16
    assert ids[0].item() == processor.tokenizer.bos_token_id
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[0]:].tolist()
    assert len(new) == 24
    # The weights are scaled so greedy output is not one token repeated forever.
    assert len(set(new)) >= 8, new


def test_chat_template_renders_llava_format(tiny_model_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it"}]}],
        add_generation_prompt=True)
    assert text == "USER: <image>\nDescribe it\nASSISTANT:"


def test_seed_changes_weights_and_fingerprint(tiny_model_dir, tiny_model_dir_other):
    assert model_fingerprint(tiny_model_dir) != model_fingerprint(tiny_model_dir_other)
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(tiny_model_dir)


def test_unknown_preset_is_a_clear_error(tmp_path):
    from common.model_maker import make_model

    with pytest.raises(ValueError, match="unknown preset"):
        make_model("huge", tmp_path)
