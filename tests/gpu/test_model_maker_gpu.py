"""The llava-1.5-7b preset: made on the GPU in seconds, loaded by transformers, generates."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.gpu


def test_llava_7b_preset_made_and_loaded_on_gpu(tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from common.model_maker import make_model

    out = tmp_path_factory.mktemp("llava7b")
    t0 = time.perf_counter()
    make_model("llava-1.5-7b", out, device="cuda")
    made_s = time.perf_counter() - t0
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 4096 and config["vision_config"]["image_size"] == 336

    t0 = time.perf_counter()
    processor = AutoProcessor.from_pretrained(out)
    model = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16, device_map="cuda").eval()
    load_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    inputs = processor(text="USER: <image>\nWhat is this? ASSISTANT:", images=[image],
                       return_tensors="pt").to("cuda")
    assert int((inputs["input_ids"] == config["image_token_index"]).sum()) == 576
    t0 = time.perf_counter()
    generated = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    gen_s = time.perf_counter() - t0
    new = generated[0, inputs["input_ids"].shape[1]:].tolist()
    print(f"\nllava-1.5-7b preset: {n_params / 1e9:.2f} B params; made on GPU in {made_s:.1f} s, "
          f"loaded by HF in {load_s:.1f} s, 16 tokens in {gen_s:.2f} s: {new}")
    assert n_params > 6.5e9
    assert len(set(new)) > 4
