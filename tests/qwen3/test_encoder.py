"""Qwen3VisionEncoder: the HF image processor and our tower give HF's [parts, tokens, hidden] per image."""

from __future__ import annotations

import math

import pytest
import torch

from common.families.qwen3_vl.encoder import Qwen3VisionEncoder


def test_encode_equals_hf(qwen3_model_dir, qwen3_oracle, qwen_images):
    encoder = Qwen3VisionEncoder(qwen3_model_dir)
    assert encoder.preprocess_mode == "hf" and encoder.parts == 4
    ours = encoder.encode(qwen_images)
    refs = qwen3_oracle.image_features(*qwen3_oracle.pixels(qwen_images))
    for image, mine, ref in zip(qwen_images, ours, refs, strict=True):
        grid = encoder.layout.grid(image.height, image.width, encoder.default_pixels)
        assert mine.shape == (4, encoder.layout.num_tokens(grid), 64) == ref.shape
        assert torch.equal(mine, ref)  # max abs diff 0 in fp32
        assert encoder.nbytes_for(grid) == mine.numel() * mine.element_size()
    assert (encoder.calls, encoder.images_encoded) == (1, 3)
    encoder.warm_up()


def test_compiled_elementwise_steps_close_to_eager(qwen3_model_dir, qwen3_oracle, qwen_images):
    """The GPU's fast path (rotary, LayerNorms and residual adds fused by torch.compile, forced here on
    the CPU) stays within 1e-4 of HF's fp32 features (outputs of size ~4; measured ~2e-6: the fused
    kernels sum in another order); switching back to the eager steps gives HF's numbers exactly again.
    On a CPU capture_graphs compiles nothing (the CPU path stays bit-equal to HF)."""
    from common.families.qwen3_vl.tower import Qwen3VisionOps

    encoder = Qwen3VisionEncoder(qwen3_model_dir)
    assert not encoder.capture_graphs(4)
    assert all(b.ops is Qwen3VisionOps for b in encoder.tower.blocks)  # eager
    refs = qwen3_oracle.image_features(*qwen3_oracle.pixels(qwen_images))
    if not encoder.compile_elementwise():
        pytest.skip("torch.compile does not work here (no C++ toolchain?)")
    compiled = "CompiledQwen3VisionOps"
    assert all(b.ops.__name__ == b.attn.ops.__name__ == compiled for b in encoder.tower.blocks)
    for mine, ref in zip(encoder.encode(qwen_images), refs, strict=True):
        assert mine.shape == ref.shape
        assert (mine - ref).abs().max().item() < 1e-4
    encoder.tower.use_ops(Qwen3VisionOps)
    assert all(torch.equal(m, r) for m, r in zip(encoder.encode(qwen_images), refs, strict=True))


class _RecordingGraphs:
    """SignatureGraphs' interface on a CPU: runs the tower eagerly and records each call's grids."""

    def __init__(self, tower, max_patches: int) -> None:
        self.tower, self.max_patches, self.calls = tower, max_patches, []

    def __call__(self, pixels, grids):
        self.calls.append(list(grids))
        return self.tower(pixels, grids)


def test_a_demand_batch_larger_than_the_graphs_replays_them_run_by_run(qwen3_model_dir, qwen_images):
    """encode_prepared(use_graphs=True) splits a batch into runs the graphs capture (at most max_patches
    patch rows each; an image larger than that alone), and the rows equal one eager forward's."""
    from common.families.qwen2_5_vl.encoder_base import graph_chunks

    encoder = Qwen3VisionEncoder(qwen3_model_dir)
    prepared = [encoder.prepare(image) for image in qwen_images] * 2
    rows = [math.prod(p.grid) for p in prepared]
    want = encoder.encode_prepared(prepared)
    cap = max(rows) + min(rows)  # two images fit only where the smallest follows the largest
    encoder.graphs = _RecordingGraphs(encoder.tower, cap)
    got = encoder.encode_prepared(prepared, use_graphs=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    runs = encoder.graphs.calls
    assert len(runs) > 1 and sum(len(r) for r in runs) == len(prepared)
    assert all(sum(math.prod(g) for g in run) <= cap or len(run) == 1 for run in runs)
    assert [p.grid for p in prepared] == [g for run in runs for g in run], "order kept"
    assert graph_chunks(prepared, None) == [prepared]
    assert [len(r) for r in graph_chunks(prepared, 1)] == [1] * len(prepared)
    assert [len(r) for r in graph_chunks(prepared, sum(rows))] == [len(prepared)]
