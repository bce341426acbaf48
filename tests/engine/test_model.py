"""Our language model against HF causal LMs: Llama (bias, llama3 rope), Mistral, Qwen2 (qkv bias, tied
embeddings), both LLaVA key layouts and both rope config styles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from decoder_svc.model import (
    AttentionMetadata,
    KVCacheSpec,
    TextModelConfig,
    allocate_kv_cache,
    load_language_model,
)
from decoder_svc.model.rope import inv_frequencies

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _write_llava_new_layout(hf_lm, out: Path, tie: bool) -> None:
    """A LLaVA-style dir with `model.language_model.*` + `lm_head.weight` keys (the newer layout)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in hf_lm.state_dict().items():
        if k == "lm_head.weight":
            if not tie:
                state[k] = v.clone()
        else:
            state["model.language_model." + k.removeprefix("model.")] = v.clone()
    save_file(state, str(out / "model.safetensors"))
    text = hf_lm.config.to_dict()
    (out / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text,
                                                 "image_token_index": 4}))


def _our_logits(model, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits for every position, computed in two chunks through the paged cache (block size 8)."""
    spec = KVCacheSpec.for_model(model.config, 16, 8, torch.float32)
    kv = allocate_kv_cache(spec, "cpu")
    table = torch.arange(16).flip(0)[None]  # non-contiguous physical blocks

    def run(lo, hi):
        pos = torch.arange(lo, hi)
        slots = table[0, pos // 8] * 8 + pos % 8
        meta = AttentionMetadata.build(slots.tolist(), [hi - lo], [hi], table.tolist(), 8, "cpu")
        return model(pos, meta, kv, torch.arange(hi - lo), input_ids=ids[lo:hi])

    with torch.no_grad():
        return torch.cat([run(0, split), run(split, len(ids))])


CASES = {
    "llama-bias-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        attention_bias=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}), False),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=32), False),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf_causal_lm(tmp_path, name):
    import transformers

    cfg_cls, model_cls, extra, tie = CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**SMALL, **extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so differences would show
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    if tie:
        hf.tie_weights()
    _write_llava_new_layout(hf, tmp_path / name, tie)
    ours = load_language_model(tmp_path / name)
    assert ours.config.qkv_bias == (name != "mistral")
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    got = _our_logits(ours, ids, split=29)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_rope_config_styles_agree():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=4)
    old = TextModelConfig.from_hf({**base, "rope_theta": 5e5,
                                   "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = TextModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5,
                                                               "factor": 2.0}})
    assert old == new and old.rope_theta == 5e5 and old.head_dim == 16
    assert torch.equal(inv_frequencies(old), inv_frequencies(new))


def test_llama3_inv_freq_equals_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope,
                         max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = inv_frequencies(TextModelConfig.from_hf(hf_cfg.to_dict()))
    assert torch.allclose(ours, ref)


def test_unsupported_configs_are_refused():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=4)
    with pytest.raises(ValueError, match="unsupported language model"):
        TextModelConfig.from_hf({**base, "model_type": "gemma"})
    with pytest.raises(ValueError, match="rope type"):
        TextModelConfig.from_hf({**base, "model_type": "llama", "rope_parameters": {"rope_type": "yarn"}})
