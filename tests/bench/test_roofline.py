"""The serving roofline's arithmetic, checked against a hand count on the tiny checkpoints' shapes."""

from __future__ import annotations

import json

import pytest

from bench.roofline import ModelShape, Workload, model_shape, patches_per_image, roofline


def test_model_shape_counts_the_tiny_llava(tiny_model_dir):
    text = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    h, i, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    d = text.get("head_dim") or h // heads
    shape = model_shape(tiny_model_dir, "float32")
    assert shape.layer_params == layers * (2 * h * heads * d + 2 * h * kv * d + 3 * h * i)
    assert shape.head_params == text["vocab_size"] * h
    assert shape.kv_bytes_per_token == 2 * layers * kv * d * 4
    assert shape.vision_params > 0  # counted from the safetensors headers
    # 16 image tokens from a CLIP tower with a CLS row
    assert patches_per_image(tiny_model_dir, 64) == 17


def test_qwen_patches_follow_the_resized_grid(qwen_model_dir):
    from common.families.qwen2_5_vl.layout import load_qwen_layout

    layout = load_qwen_layout(qwen_model_dir)
    t, gh, gw = layout.grid(200, 200, layout.pixel_range())
    assert patches_per_image(qwen_model_dir, 200) == t * gh * gw


def test_roofline_adds_compute_and_memory_time():
    shape = ModelShape(layer_params=1000, head_params=100, num_layers=2, query_width=8, kv_bytes_per_token=16,
                       vision_params=50, dtype_bytes=2)
    work = Workload(requests=4, mean_prompt_tokens=10, output_len=3, concurrency=2, distinct_images=3,
                    patches_per_image=5)
    r = roofline(shape, work, peak=1e6, bandwidth=1e3)
    assert r["prefill_flops"] == 4 * (2 * 10 * 1000 + 2 * 2 * 8 * 100 + 2 * 100)
    assert r["vision_flops"] == 3 * 2 * 50 * 5
    assert r["decode_steps"] == 2 * 2  # two rounds of two requests, output_len - 1 steps each
    assert r["decode_bytes"] == 4 * 1100 * 2 + 4 * (11 + 12) * 16
    compute = (r["prefill_flops"] + r["vision_flops"]) / 1e6
    assert r["roofline_s"] == pytest.approx(compute + r["decode_bytes"] / 1e3)
