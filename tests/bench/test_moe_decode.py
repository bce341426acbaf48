"""The mixture-of-experts benchmarks on CPU: bench.moe_decode's smoke run on the tiny Qwen3-VL-MoE (counts,
not timings), the router spread evening out a skewed router, the expert-load summary, and the roofline and
workload asking the family (active parameters, Qwen prompts and grids for qwen3_vl_moe)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from bench import moe_decode
from bench.moe_routing import ExpertProbe, expert_load, routers, spread_routers
from bench.roofline import ModelShape, Workload, expected_experts, model_shape, patches_per_image, roofline
from bench.workload import QWEN_IMAGE, PromptMaker, build_requests
from tests.family_fixtures import made_checkpoint


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return made_checkpoint(tmp_path_factory, "qwen3-vl-moe-tiny", seed=0)


def _text(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())["text_config"]


def test_moe_decode_smoke_on_dummy_weights(moe_dir, tmp_path):
    """Both quantizations, the routers spread (dummy weights), HF on its own random init; every stream
    decodes output_len - 1 timed tokens, one step hits top_k experts per layer, the probe saw every prompt
    token in every layer, FP8 experts are fewer bytes."""
    out = tmp_path / "moe.json"
    moe_decode.main(["--model", str(moe_dir), "--batch-sizes", "1,2", "--prompt-len", "8",
                     "--output-len", "4", "--calibration-tokens", "32", "--quantization", "none,fp8",
                     "--load-format", "dummy", "--hf-repeats", "1", "--copy-bytes", str(8 << 20),
                     "--out", str(out)])
    payload = json.loads(out.read_text())
    text = _text(moe_dir)
    top_k, layers = text["num_experts_per_tok"], text["num_hidden_layers"]
    assert payload["router_spread"] is True and payload["hf_weights"] == "random"
    rows = payload["results"]
    runs = [(r["quantization"], r["batch"]) for r in rows]
    assert runs == [("none", 1), ("none", 2), ("fp8", 1), ("fp8", 2)]
    for r in rows:
        assert r["engine_decode_tokens"] == r["batch"] * 3
        assert r["bound_tokens_per_s"] > 0 and r["step_bytes"] > 0
        assert r["hf_tokens_per_s"] is None or r["hf_tokens_per_s"] > 0
        assert top_k <= r["experts_hit_per_layer"] <= min(r["batch"] * top_k, text["num_local_experts"])
    assert [r["experts_hit_per_layer"] for r in rows if r["batch"] == 1] == [top_k, top_k]
    assert [r["over_bf16"] is None for r in rows] == [True, True, False, False]  # FP8 over bf16
    for r in (r for r in rows if r["batch"] == 1):  # b1 reads: every shared weight, one row, top_k experts
        parts = payload["step_bytes"][r["quantization"]]
        context = 8 + 4 / 2  # each stream's mean context over the timed steps
        want = (parts["shared"] + parts["embedding_row"] + layers * top_k * parts["expert"]
                + context * parts["kv_per_token"])
        assert r["bytes_per_token"] == pytest.approx(want)
    for quant, load in payload["expert_load"].items():
        assert load["tokens"] == 2 * 8 and load["streams"] == 2, quant  # two prompts of 8 tokens
        assert sum(load["histogram"]) == load["tokens"] * top_k * layers
    assert payload["step_bytes"]["fp8"]["expert"] < payload["step_bytes"]["none"]["expert"] / 3
    figures = dict(payload["headline"])  # bench.merge's table
    assert figures["MoE decode fp8 b1: over bf16"] == rows[2]["over_bf16"]


def _skewed_inputs(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    shared = torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 8  # what every token carries
    return shared + torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


def test_router_spread_evens_out_a_skewed_router():
    experts, hidden, top_k = 16, 64, 2
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate = nn.Linear(hidden, experts, bias=False)
    torch.nn.init.normal_(model.mlp.gate.weight, std=hidden**-0.5, generator=torch.Generator().manual_seed(1))
    found = routers(model, experts, hidden)
    assert found == [model.mlp.gate]

    def imbalance() -> float:
        probe = ExpertProbe(found, top_k)
        probe.recording = True
        with torch.no_grad():
            model.mlp.gate(_skewed_inputs(4096, hidden, seed=3))
        probe.close()
        return expert_load(probe.layer_ids(), experts, 1).imbalance_max

    before = imbalance()
    with torch.no_grad():
        spread_routers(found, lambda: model.mlp.gate(_skewed_inputs(2048, hidden, seed=2)))
    after = imbalance()
    assert before > 3.0 and after < 1.3, (before, after)  # 8.0 would be every token on the same two experts


def test_router_spread_says_when_a_router_did_not_run():
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate = nn.Linear(8, 4, bias=False)
    with pytest.raises(RuntimeError, match="1 of 1 routers did not run eagerly"):
        spread_routers(routers(model, 4, 8), lambda: None)


def test_expert_load_counts_the_experts_one_step_hits():
    # two streams of three tokens each, top_k 1: positions hit {0, 1}, {2}, {1, 3}
    ids = [torch.tensor([[0], [2], [1], [1], [2], [3]])]
    load = expert_load(ids, num_experts=4, streams=2)
    assert load.tokens == 6 and load.histogram == [1, 2, 2, 1]
    assert load.experts_per_step == pytest.approx(5 / 3) and load.imbalance_max == pytest.approx(2 / 1.5)
    # runs of 2, 2, 1, 1 tokens (lengths a token apart): one position, tokens 0, 2, 4, 5
    assert expert_load(ids, num_experts=4, streams=4).experts_per_step == 4
    assert expert_load(ids, num_experts=4, streams=7).experts_per_step is None


def test_roofline_counts_a_moes_active_parameters(moe_dir):
    text = _text(moe_dir)
    h, layers, width = text["hidden_size"], text["num_hidden_layers"], text["moe_intermediate_size"]
    experts, top_k, d = text["num_local_experts"], text["num_experts_per_tok"], text["head_dim"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    shape = model_shape(moe_dir, "float32")
    attention = 2 * h * q + 2 * h * kv
    assert shape.layer_params == layers * (attention + h * experts + top_k * 3 * h * width)
    assert (shape.moe_layers, shape.num_experts, shape.top_k) == (layers, experts, top_k)
    assert shape.expert_params == 3 * h * width
    assert shape.decode_step_bytes(1) == shape.decode_weight_bytes  # one token reads top_k experts
    many = shape.decode_step_bytes(10_000)  # every expert
    assert many == pytest.approx(shape.decode_weight_bytes + layers * (experts - top_k) * 3 * h * width * 4)
    work = Workload(requests=4, mean_prompt_tokens=10, output_len=3, concurrency=4, distinct_images=0,
                    patches_per_image=0)
    r = roofline(shape, work, peak=1e9, bandwidth=1e9)
    assert r["decode_bytes"] == pytest.approx(2 * shape.decode_step_bytes(4)
                                              + 4 * (11 + 12) * shape.kv_bytes_per_token)


def test_expected_experts():
    assert expected_experts(128, 8, 1) == 8
    assert expected_experts(128, 8, 32) == pytest.approx(128 * (1 - (120 / 128) ** 32))
    dense = ModelShape(layer_params=10, head_params=2, num_layers=1, query_width=1, kv_bytes_per_token=1,
                       vision_params=0, dtype_bytes=2)
    assert dense.decode_step_bytes(32) == dense.decode_weight_bytes == 24


def test_moe_prompts_and_grids_are_qwens(moe_dir):
    from common.families.qwen3_vl_moe.layout import Qwen3MoeImageLayout

    req = build_requests(1, 0.0, 8, PromptMaker(moe_dir), image_size=32)[0]
    assert req.prompt.count(QWEN_IMAGE) == 1 and req.prompt.startswith("<|im_start|>user\n")
    layout = Qwen3MoeImageLayout.from_checkpoint(moe_dir, json.loads((moe_dir / "config.json").read_text()))
    t, gh, gw = layout.grid(200, 200, layout.pixel_range())
    assert patches_per_image(moe_dir, 200) == t * gh * gw


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_step_bytes_split_every_weight_once(moe_dir, quantization):
    from bench.bandwidth import weight_bytes
    from bench.moe_routing import step_bytes
    from decoder_svc.model.loader import load_language_model

    model = load_language_model(moe_dir, "cpu", torch.float32, "torch", quantization=quantization)
    cfg, embed = model.config, model.embed_tokens.weight
    parts = step_bytes(model, kv_per_token=7)
    table = 0 if model.lm_head.weight is embed else embed.numel() * embed.element_size()
    experts = parts.expert * parts.moe_layers * cfg.num_experts
    assert parts.shared + experts + table == weight_bytes(model)
    assert parts.embedding_row == cfg.hidden_size * 4 and parts.moe_layers == cfg.num_layers
    one = model.layers[0].mlp.experts
    assert parts.expert == sum(p.numel() * p.element_size() for p in one.parameters()) / cfg.num_experts


def test_a_hybrid_moe_step_reads_and_writes_each_streams_state(qwen3_5_moe_model_dir, tmp_path):
    """bench.moe_decode on Qwen3.5-MoE (a hybrid stack): the bound counts the linear layers' state of
    every stream, read and written, and the KV of the attention layers only."""
    from bench import moe_decode
    from decoder_svc.model.config import TextModelConfig
    from decoder_svc.model.linear_state import LinearStatePool
    from decoder_svc.model.loader import text_config_dict

    out = tmp_path / "moe.json"
    moe_decode.main(["--model", str(qwen3_5_moe_model_dir), "--batch-sizes", "1,2", "--output-len", "3",
                     "--prompt-len", "8", "--hf-weights", "none", "--out", str(out)])
    payload = json.loads(out.read_text())
    cfg = TextModelConfig.from_hf(text_config_dict(qwen3_5_moe_model_dir))
    parts = payload["step_bytes"]["none"]
    assert parts["state_per_stream"] == 2 * LinearStatePool.bytes_per_slot(cfg, torch.float32) > 0
    assert parts["kv_per_token"] == 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 4
    assert all(r["engine_tokens_per_s"] > 0 for r in payload["results"])
