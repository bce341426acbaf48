"""Adapters composed with the rest of the decoder: CUDA-graph-shaped steps (emulated on a CPU, as
tests/engine/test_graph_shapes.py does: pad rows take slot 0), FP8 base weights (the LoRA product adds on
top of the quantized one), and the family's seam that picks an adapter by a request's content."""

from __future__ import annotations

import torch

from common.families.layout import ImageLayout
from decoder_svc.model.lora import LoRALinear
from decoder_svc.model.quant.linear import Fp8Linear
from decoder_svc.runner import model_runner
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.lora.test_lora_engine import LONG, TEXT
from tests.oracle import greedy, run_all

N = 10


def test_graph_steps_mix_adapters(make_lora_engine, merged_oracles, monkeypatch):
    """Decode steps of three sequences replay the 4-sequence graph: a pad row runs under slot 0 and the
    real rows under their own adapters, all in one captured shape."""
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    engine = make_lora_engine(max_num_seqs=8)
    plan = {"x": ("a1", TEXT), "y": ("a2", LONG), "z": ("", TEXT)}
    for rid, (adapter, prompt) in plan.items():
        engine.add_request(rid, prompt, sampling=greedy(N), lora_adapter=adapter)
    results = run_all(engine)
    replayed = engine.runner.graphs.replayed
    assert any(key.decode and key.num_seqs == 4 for key in replayed)
    for rid, (adapter, prompt) in plan.items():
        merged_oracles[adapter].assert_same_tokens(results[rid]["tokens"], prompt, [], N)


class PadRowGraphs(EmulatedGraphs):
    """EmulatedGraphs that record, at each replay with the LoRA product, the adapter slots of its pad rows
    (the rows with no KV slot) as the device buffers hold them."""

    pad_slots: list[list[int]]

    def capture(self, run, progress: bool = True, mix_out=None) -> None:
        super().capture(run, progress, mix_out)
        self.pad_slots = []

    def replay(self, key, linear_state=None, rows=0):
        if key.lora:
            d = self._run.__self__.buffers.dev  # the runner whose static forward was captured
            rows = slice(0, key.num_tokens)
            self.pad_slots.append(d["lora_slots"][rows][d["slot_mapping"][rows] == -1].tolist())
        return super().replay(key, linear_state, rows)


def test_graph_pad_rows_take_the_base_models_slot(make_lora_engine, monkeypatch):
    """A graph's pad rows run slot 0 whatever an earlier step left in their rows of the buffers: the
    prompts' prefill fills rows 0.. with adapter slots, then 3-sequence decodes pad row 3."""
    monkeypatch.setattr(model_runner, "StepGraphs", PadRowGraphs)
    engine = make_lora_engine(max_num_seqs=8)
    for rid, adapter in {"x": "a1", "y": "a2", "z": ""}.items():
        engine.add_request(rid, TEXT, sampling=greedy(4), lora_adapter=adapter)
    run_all(engine)
    pads = [s for s in engine.runner.graphs.pad_slots if s]
    assert pads and all(slot == 0 for s in pads for slot in s), pads


def test_fp8_base_weights_take_the_adapter(make_lora_engine):
    """With FP8 projections the wrapped module is the Fp8Linear, and a row's output is the FP8 product
    plus its adapter's (the torch reference's) product."""
    engine = make_lora_engine(quantization="fp8")
    qkv = engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoRALinear) and isinstance(qkv.base, Fp8Linear)
    x = torch.randn(3, qkv.in_features)
    qkv.slots.bind(torch.tensor([0, 1, 2]), 3)
    out = qkv(x)
    base = qkv.base(x)
    assert torch.equal(out[0], base[0])
    for row in (1, 2):
        cols = slice(row * qkv.rank, (row + 1) * qkv.rank)
        want = base[row] + (x[row] @ qkv.lora_a[cols].T) @ qkv.lora_b[:, cols].T
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)
    plain = engine.generate("base", TEXT, sampling=greedy(N)).new_token_ids
    adapted = engine.generate("a1", TEXT, sampling=greedy(N), lora_adapter="a1").new_token_ids
    assert plain != adapted


def test_family_picks_an_adapter_by_content(make_lora_engine, monkeypatch):
    """The seam Phi-4-multimodal needs: a layout that runs image requests under its vision adapter; a
    request's own adapter wins, and text requests run on the base model."""
    engine = make_lora_engine()
    monkeypatch.setattr(type(engine.inputs.layout), "request_adapter",
                        lambda self, has_images, has_videos: "a2" if has_images else None)
    from tests.oracle import make_image

    image = make_image(1, (40, 52))
    assert engine.inputs.make_request("i", "USER: <image>\nhi ASSISTANT:", [image]).lora_adapter == "a2"
    assert engine.inputs.make_request("o", "USER: <image>\nhi ASSISTANT:", [image],
                                      lora_adapter="a1").lora_adapter == "a1"
    assert engine.inputs.make_request("t", TEXT).lora_adapter == ""
    assert ImageLayout.request_adapter(engine.inputs.layout, True, False) is None  # the default: none
