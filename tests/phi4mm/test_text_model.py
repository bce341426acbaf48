"""Phi-4-multimodal's text model (Phi-4-mini layers) in the decoder: the parsed config's fields, the rope
table against HF's Phi4MultimodalRotaryEmbedding (partial rotary 0.75, LongRoPE's short factors and
attention factor), the rotary ops (torch reference and Triton in its interpreter) against HF's
apply_rotary_pos_emb, LoRA-wrapped checkpoint names, and tensor-parallel cuts of the fused tensors."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/engine/test_ops.py)

from common.checkpoint import CheckpointError  # noqa: E402
from decoder_svc.model import TextModelConfig, load_language_model  # noqa: E402
from decoder_svc.model.loader import rename_language_model_key, text_config_dict  # noqa: E402
from decoder_svc.model.ops import TorchOps  # noqa: E402
from decoder_svc.model.parallel import TensorParallel, finish_shard  # noqa: E402
from decoder_svc.model.rope import cos_sin_table  # noqa: E402


@pytest.fixture(scope="module")
def cfg_dict(phi4_tiny_dir: Path) -> dict:
    return text_config_dict(phi4_tiny_dir)


@pytest.fixture(scope="module")
def hf_model(phi4_tiny_dir: Path):
    from common.families.phi4mm.oracle import load_hf_model

    return load_hf_model(phi4_tiny_dir)  # the base model: its weights from `.base_layer.`


def test_config_fields(cfg_dict: dict) -> None:
    cfg = TextModelConfig.from_hf(cfg_dict)
    assert cfg.model_type == "phi4_multimodal" and cfg.head_dim == 16 and cfg.rotary_dim == 12
    assert cfg.rotary_dims == 12 and cfg.rope_type == "longrope" and cfg.tie_word_embeddings
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.mlp_bias and not cfg.qk_norm
    # HF's default attention factor: sqrt(1 + ln(131072 / 4096) / ln(4096)), from the full max length.
    assert cfg.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    # Served only up to original_max_position_embeddings (decoder_svc/model/longrope.py says why).
    assert cfg.max_position_embeddings == 131072 and cfg.max_model_len == 4096


def test_config_refusals(cfg_dict: dict) -> None:
    rope = dict(cfg_dict["rope_parameters"])
    with pytest.raises(CheckpointError, match="short_factor must have 6"):
        TextModelConfig.from_hf({**cfg_dict, "rope_parameters": {**rope, "short_factor": [1.0] * 8}})
    llama = {k: cfg_dict[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads")}
    with pytest.raises(CheckpointError, match="partial rotary"):  # still refused outside Phi-4
        TextModelConfig.from_hf({**llama, "model_type": "llama", "partial_rotary_factor": 0.5})


def test_explicit_attention_factor(cfg_dict: dict) -> None:
    rope = {**cfg_dict["rope_parameters"], "attention_factor": 1.25}
    assert TextModelConfig.from_hf({**cfg_dict, "rope_parameters": rope}).rope_attention_factor == 1.25


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.9}, {"factor": 1.0}])
def test_rope_table_equals_hf(cfg_dict: dict, extra: dict) -> None:
    """Our fp32 cos/sin rows are bit-equal to HF's rotary module's for positions up to original_max."""
    from transformers import Phi4MultimodalConfig
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalRotaryEmbedding

    d = {**cfg_dict, "rope_parameters": {**cfg_dict["rope_parameters"], **extra}}
    ours = cos_sin_table(TextModelConfig.from_hf(d), TorchOps.make_cos_sin_cache)
    text = {k: v for k, v in d.items() if k not in ("vision_config", "audio_config")}
    hf_cfg = Phi4MultimodalConfig(**text)
    rotary = Phi4MultimodalRotaryEmbedding(hf_cfg)
    positions = torch.tensor([[0, 1, 2, 17, 255, 1000, 4000, 4095]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    assert ours.shape == (4096, 12) and cos.shape[-1] == 12
    assert torch.equal(ours[positions[0]], torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_ops_equal_hf(cfg_dict: dict, dtype: torch.dtype) -> None:
    """TorchOps.rotary (and TritonOps.rotary, in place on a fused qkv buffer) rotate the first 12 of 16
    dims as HF's apply_rotary_pos_emb does, and pass the last 4 through."""
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import apply_rotary_pos_emb

    table = cos_sin_table(TextModelConfig.from_hf(cfg_dict), TorchOps.make_cos_sin_cache)
    gen = torch.Generator().manual_seed(3)
    n, hq, hk, d = 5, 4, 2, 16
    buf = (torch.randn(n, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype)
    q, k = buf[:, :hq * d].view(n, hq, d), buf[:, hq * d:(hq + hk) * d].view(n, hk, d)
    positions = torch.tensor([0, 3, 100, 2048, 4095])
    rows = table[positions]
    cos = torch.cat((rows[:, :6], rows[:, :6]), -1).to(dtype)[None]
    sin = torch.cat((rows[:, 6:], rows[:, 6:]), -1).to(dtype)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    got_q, got_k = TorchOps.rotary(q, k, positions, table)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_q[..., 12:], q[..., 12:])
    triton = pytest.importorskip("triton")
    assert triton
    from decoder_svc.model.kernel_dispatch import TritonOps

    before = buf.clone()
    TritonOps.rotary(q, k, positions, table)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 or not torch.cuda.is_available() else {}
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(buf[:, (hq + hk) * d:], before[:, (hq + hk) * d:])  # v untouched
    assert torch.equal(q[..., 12:], before[:, :hq * d].view(n, hq, d)[..., 12:])  # pass-through dims


def test_lora_names() -> None:
    """PEFT-wrapped layers (the remote-code export): the base weight is read, the adapters are not."""
    base = "model.layers.3.self_attn.qkv_proj"
    assert rename_language_model_key(f"{base}.base_layer.weight") == "layers.3.self_attn.qkv_proj.weight"
    assert rename_language_model_key(f"{base}.lora_A.vision.weight") is None
    assert rename_language_model_key(f"{base}.lora_B.speech.weight") is None
    assert rename_language_model_key("model.embed_tokens_extend.image_embed.glb_GN") is None
    assert rename_language_model_key("model.embed_tokens.weight") == "embed_tokens.weight"


def test_loads_every_language_weight(phi4_tiny_dir: Path, hf_model) -> None:
    """Every parameter equals HF's (strict load; the tied head is the embeddings); the LoRA-wrapped
    projections' base weights are read from `.base_layer.`."""
    ours = load_language_model(phi4_tiny_dir, "cpu", torch.float32, attention_backend="torch")
    hf = hf_model.state_dict()
    assert any(".base." in name for name, _ in ours.named_parameters())  # the vision adapter is attached
    for name, param in ours.state_dict().items():
        name = name.replace(".base.", ".")
        key = "lm_head.weight" if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(param, hf[key]), name
    assert ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_cuts_fused_parts(cfg_dict: dict, rank: int) -> None:
    """A checkpoint-fused qkv_proj / gate_up_proj (read whole) becomes this rank's q|k|v and gate|up rows."""
    cfg = TextModelConfig.from_hf(cfg_dict)  # 4 q heads, 2 KV heads, head_dim 16, MLP 128
    tp = TensorParallel(rank, 2)
    qkv = torch.arange(128 * 64, dtype=torch.float32).view(128, 64)
    gate_up = torch.arange(256 * 64, dtype=torch.float32).view(256, 64)
    state = {"layers.0.self_attn.qkv_proj.weight": qkv.clone(),
             "layers.0.mlp.gate_up_proj.weight": gate_up.clone(), "embed_tokens.weight": torch.zeros(512, 64)}
    finish_shard(state, cfg, tp)
    q, k, v = qkv[:64], qkv[64:96], qkv[96:]
    mine = slice(16 * rank, 16 * (rank + 1))  # one KV head of 16 rows each; two q heads of 16
    want = torch.cat((q[32 * rank:32 * (rank + 1)], k[mine], v[mine]))
    assert torch.equal(state["layers.0.self_attn.qkv_proj.weight"], want)
    gate, up = gate_up[:128], gate_up[128:]
    want = torch.cat((gate[64 * rank:64 * (rank + 1)], up[64 * rank:64 * (rank + 1)]))
    assert torch.equal(state["layers.0.mlp.gate_up_proj.weight"], want)
