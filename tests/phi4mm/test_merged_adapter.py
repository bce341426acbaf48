"""Phi-4-MM's vision adapter merged at load (decoder_svc/model/lora/merged.py): each targeted projection
gets W + scale * B @ A as HF's oracle merges it, a forward on those weights gives the LoRA product's
logits (fp32), and a step runs them only when every row runs the vision adapter: image requests alone
take the merged path (eagerly and through the emulated CUDA graphs' third set), a batch mixing image and
text requests the LoRA path, both with HF's greedy tokens. The deterministic mode, FP8 projections and
--no-merge-builtin-adapter merge nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench import decode_tput
from common.config import from_args
from common.families.phi4mm.lora_weights import merged_language_state
from common.images import encode_png
from decoder_svc.config import DecoderConfig
from decoder_svc.main import build_arg_parser
from decoder_svc.model import KVCacheSpec, allocate_kv_cache, load_language_model
from decoder_svc.model.attention import AttentionMetadata
from decoder_svc.model.lora import LoRALinear
from decoder_svc.runner import model_runner
from decoder_svc.runner.cuda_graphs import GraphKey, StepGraphs
from decoder_svc.runner.model_runner import ModelRunner
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.oracle import greedy, run_all
from tests.phi4mm.test_vision_lora import ONE, TEXT, N, _images, _run, make_engine

VISION_SLOT = 1  # the only adapter: slot 1


@pytest.fixture(scope="module")
def want(phi4_oracle):
    """HF's greedy tokens of a (prompt, image indices) case (the vision adapter merged with images)."""
    return lambda case: phi4_oracle.generate(case[0], _images(case[1]), N)


@pytest.fixture(scope="module")
def model(phi4_tiny_dir):
    return load_language_model(phi4_tiny_dir, "cpu", torch.float32, "torch")


def _wrapped(model) -> list[tuple[str, LoRALinear]]:
    return [(f"model.layers.{i}.{block}.{name}.weight", getattr(getattr(layer, block), name))
            for i, layer in enumerate(model.layers)
            for block, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                                ("mlp", "down_proj"))]


def test_the_merged_weights_are_the_oracles(model, phi4_tiny_dir):
    """Every targeted projection's merged copy is W + lora_alpha / r * B @ A of the checkpoint's own
    tensors (the oracle's merge), a buffer beside its base (the model's parameters stay the base's)."""
    merged = merged_language_state(phi4_tiny_dir, "vision")
    base = merged_language_state(phi4_tiny_dir, None)
    assert model.lora.merged_slot == VISION_SLOT
    params = {id(p) for p in model.parameters()}
    for name, proj in _wrapped(model):
        assert isinstance(proj, LoRALinear) and proj.merged is not None, name
        assert id(proj.merged.weight) not in params and proj.merged.bias is proj.base.bias
        torch.testing.assert_close(proj.merged.weight, merged[name], rtol=1e-6, atol=1e-6)
        assert (merged[name] - base[name]).abs().max() > 1e-3  # the adapter moves this weight


def _forward(model, ids: torch.Tensor, slots: torch.Tensor | None, merged: bool = False) -> torch.Tensor:
    n, bs = ids.shape[0], 16
    cache = allocate_kv_cache(KVCacheSpec.for_model(model.config, 2, bs, torch.float32), "cpu")
    meta = AttentionMetadata.build(list(range(n)), [n], [n], [[0, 1]], bs, "cpu")
    with torch.inference_mode():
        return model(torch.arange(n), meta, cache, torch.arange(n), input_ids=ids, lora_slots=slots,
                     merged_adapter=merged)


def test_merged_logits_equal_the_lora_products(model):
    """A forward on the merged weights gives the per-row LoRA product's logits within fp32 rounding, and
    not the base model's; merged_adapter holds for its own forward only."""
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    lora = _forward(model, ids, torch.full((24,), VISION_SLOT))
    merged = _forward(model, ids, None, merged=True)
    assert model.lora.merged and not model.lora.active
    base = _forward(model, ids, None)
    assert not model.lora.merged
    torch.testing.assert_close(merged, lora, rtol=1e-5, atol=1e-5)
    assert (base - lora).abs().max() > 1e-2
    with pytest.raises(ValueError, match="no per-row slots"):
        _forward(model, ids, torch.full((24,), VISION_SLOT), merged=True)


@pytest.mark.parametrize("slots, want_path", [
    ({1}, (False, True)), ({0, 1}, (True, False)), ({1, 2}, (True, False)), ({2}, (True, False)),
    ({0}, (False, False))])
def test_the_step_path_follows_every_rows_slot(slots, want_path):
    """(lora, merged) of a step: merged only when every row runs the merged slot (1); a row on the base
    model or on a user adapter (slot 2) keeps the LoRA product; without a merged slot never merged."""
    batch = SimpleNamespace(sequences=[SimpleNamespace(lora_slot=s) for s in sorted(slots) * 2])
    runner = SimpleNamespace(model=SimpleNamespace(lora=SimpleNamespace(merged_slot=1)))
    assert ModelRunner._adapter_path(runner, batch) == want_path
    runner.model.lora.merged_slot = None
    assert ModelRunner._adapter_path(runner, batch) == (slots != {0}, False)


def test_graph_keys_with_a_merged_adapter():
    """A third graph set over the merged weights; a step picks it only by asking for it."""
    plain, merged = StepGraphs(8, 40), StepGraphs(8, 40, lora=True, merged=True)
    assert set(merged.keys) == set(plain.keys) | {GraphKey(k.decode, k.size, True) for k in plain.keys} \
        | {GraphKey(k.decode, k.size, False, True) for k in plain.keys}
    merged._graphs = dict.fromkeys(merged.keys)
    assert merged.key_for(3, 3, plain_decode=True, merged=True) == GraphKey(True, 4, False, True)
    assert merged.key_for(2, 40, plain_decode=False, merged=True) == GraphKey(False, 64, False, True)
    assert merged.key_for(3, 3, plain_decode=True) == GraphKey(True, 4)
    lora_only = StepGraphs(8, 40, lora=True)
    lora_only._graphs = dict.fromkeys(lora_only.keys)
    assert lora_only.key_for(3, 3, plain_decode=True, merged=True) is None


def test_image_requests_alone_run_merged_and_equal_hf(phi4_tiny_dir, want, monkeypatch):
    """Every step of image requests alone runs the merged weights, decode steps in the merged graphs
    (emulated: the captured forward over the static buffers), with HF's tokens."""
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    engine = make_engine(phi4_tiny_dir)
    runner = engine.runner
    assert _run(engine, "one", ONE).new_token_ids == want(ONE)
    replayed = runner.graphs.replayed
    assert runner.lora_steps == 0 and runner.merged_steps >= N
    assert replayed and all(k.merged and not k.lora for k in replayed)


def test_a_mixed_batch_runs_the_lora_path_and_equals_hf(phi4_tiny_dir, want):
    """An image and a text request in the same steps: the LoRA product, HF's tokens for each."""
    engine = make_engine(phi4_tiny_dir)
    plan = {"i": ONE, "t": TEXT}
    for rid, case in plan.items():
        engine.add_request(rid, case[0], [encode_png(im) for im in _images(case[1])], sampling=greedy(N))
    results = run_all(engine)
    for rid, case in plan.items():
        assert results[rid]["tokens"] == want(case), rid
    assert engine.runner.lora_steps >= N and engine.runner.merged_steps == 0


def test_deterministic_mode_fp8_and_the_flag_merge_nothing(phi4_tiny_dir):
    """A row's products must not follow its step's company in the deterministic mode; FP8 projections
    have no merged copies; --no-merge-builtin-adapter reaches the loader."""
    args = build_arg_parser().parse_args(["--model", str(phi4_tiny_dir), "--encoder", "a:1",
                                          "--no-merge-builtin-adapter"])
    engine_config = from_args(DecoderConfig, args).engine
    assert engine_config.merge_builtin_adapter is False
    for kwargs in ({"deterministic": True}, {"quantization": "fp8"}, {"merge_builtin_adapter": False}):
        m = load_language_model(phi4_tiny_dir, "cpu", torch.float32, "torch", **kwargs)
        assert m.lora.merged_slot is None, kwargs
        assert all(p.merged is None for _, p in _wrapped(m)), kwargs
    engine = make_engine(phi4_tiny_dir, merge_builtin_adapter=False)
    _run(engine, "img", ONE)
    assert engine.runner.merged_steps == 0 and engine.runner.lora_steps > 0


def test_the_decode_bench_measures_image_decode_merged_and_not(phi4_tiny_dir, tmp_path):
    """bench.decode_tput --lora-adapter vision --merge-builtin-adapter both: a row per mode and batch, each
    saying which path its steps took."""
    out = tmp_path / "decode.json"
    decode_tput.main(["--model", str(phi4_tiny_dir), "--batch-sizes", "2", "--prompt-len", "8",
                      "--output-len", "4", "--copy-bytes", str(8 << 20), "--no-hf",
                      "--lora-adapter", "vision", "--merge-builtin-adapter", "both", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["merge_builtin_adapter"], r["batch"]) for r in rows] == [(True, 2), (False, 2)]
    for r in rows:
        on_path, off_path = ("merged_steps", "lora_steps")[::1 if r["merge_builtin_adapter"] else -1]
        assert r[on_path] >= 3 and r[off_path] == 0, r
        assert r["weights_bound_tokens_per_s"] > r["bound_tokens_per_s"] > 0
