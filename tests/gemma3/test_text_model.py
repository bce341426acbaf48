"""Gemma 3's text model on the torch path equals HF's in fp32: the parsed config's fields (both rope styles),
the logits of a prompt longer than the sliding window (chunked prefill and decodes through the paged cache,
alone and batched with another sequence), and the refusal of kernels that cannot mask a window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_svc.model import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    LlamaForCausalLM,
    TextModelConfig,
    TorchAttentionBackend,
    allocate_kv_cache,
    load_language_model,
)
from decoder_svc.model.config import FULL, SLIDING
from decoder_svc.model.loader import text_config_dict

BLOCK = 8
PROMPT = ("<start_of_turn>user\nwrite a long story about a red car that drives along the coast at night, "
          "past the lighthouse and the harbour<end_of_turn>\n<start_of_turn>model\n")


@pytest.fixture(scope="module")
def hf_lm(gemma3_tiny_dir: Path):
    """HF's Gemma3ForConditionalGeneration, fp32 (text-only inputs reach only its language model)."""
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(gemma3_tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(gemma3_tiny_dir: Path) -> LlamaForCausalLM:
    return load_language_model(gemma3_tiny_dir, "cpu", torch.float32, attention_backend="torch")


def prompt_ids(model_dir: Path, text: str = PROMPT) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)(text, return_tensors="pt")[
        "input_ids"][0]


def test_config_fields(gemma3_tiny_dir: Path) -> None:
    cfg = TextModelConfig.from_hf(text_config_dict(gemma3_tiny_dir))
    assert cfg.model_type == "gemma3_text" and cfg.qk_norm and cfg.norm_unit_offset and cfg.sandwich_norms
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL,)
    assert [cfg.layer_window(i) for i in range(6)] == [16] * 5 + [None]
    assert cfg.embed_scale == 8.0 and cfg.attention_scale == 32 ** -0.5
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope_theta == 1e4 and cfg.local_rope().rope_scaling == {}
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_logit_softcapping is None
    # Per-layer windows are masked by the attention: the window no longer caps the length.
    assert cfg.max_model_len == 131072


def test_config_hub_rope_style(gemma3_tiny_dir: Path) -> None:
    """config.json as published on the Hub: rope_theta, rope_scaling, rope_local_base_freq and the layer
    pattern as an int, no layer_types."""
    new = text_config_dict(gemma3_tiny_dir)
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=6)
    assert TextModelConfig.from_hf(old) == TextModelConfig.from_hf(new)
    with pytest.raises(Exception, match="attn_logit_softcapping"):
        TextModelConfig.from_hf({**new, "attn_logit_softcapping": 50.0})


def _run(model: LlamaForCausalLM, kv: list[torch.Tensor],
         seqs: list[tuple[list[int], torch.Tensor, int, int]]) -> tuple[torch.Tensor, ...]:
    """One step over several sequences: (block table, all their ids, first new position, end) each.
    Returns each sequence's logits for its new positions."""
    slots, qlens, lens, tables, ids, pos = [], [], [], [], [], []
    for table, seq_ids, lo, hi in seqs:
        p = torch.arange(lo, hi)
        slots += (torch.tensor(table)[p // BLOCK] * BLOCK + p % BLOCK).tolist()
        qlens.append(hi - lo)
        lens.append(hi)
        tables.append(table)
        ids.append(seq_ids[lo:hi])
        pos.append(p)
    meta = AttentionMetadata.build(slots, qlens, lens, tables, BLOCK, "cpu")
    n = sum(qlens)
    with torch.no_grad():
        logits = model(torch.cat(pos), meta, kv, torch.arange(n), input_ids=torch.cat(ids))
    return logits.split(qlens)


def test_logits_match_hf_beyond_window(gemma3_tiny_dir: Path, hf_lm, ours) -> None:
    """Two prefill chunks, then single decodes, through non-contiguous blocks: every position's logits
    equal HF's (a prompt of > 2 windows, so the local layers mask keys)."""
    ids = prompt_ids(gemma3_tiny_dir)
    assert len(ids) > 2 * 16 + 5
    with torch.no_grad():
        want = hf_lm(input_ids=ids[None]).logits[0]
    kv = allocate_kv_cache(KVCacheSpec.for_model(ours.config, 16, BLOCK, torch.float32), "cpu")
    table = torch.arange(16).flip(0).tolist()
    n = len(ids)
    got = [*_run(ours, kv, [(table, ids, 0, 13)]), *_run(ours, kv, [(table, ids, 13, n - 3)])]
    got += [_run(ours, kv, [(table, ids, i, i + 1)])[0] for i in range(n - 3, n)]
    got = torch.cat(got)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # The window matters here: attending to every key in the local layers gives other logits past it.
    windows = [layer.self_attn.window for layer in ours.layers]
    try:
        for layer in ours.layers:  # a window wider than the prompt: still a local layer (its rope)
            if layer.sliding:
                layer.self_attn.window = 1 << 20
        full = _run(ours, kv, [(table, ids, 0, n)])[0]
    finally:
        for layer, w in zip(ours.layers, windows, strict=True):
            layer.self_attn.window = w
    assert (full[:16] - want[:16]).abs().max() < 1e-4
    assert (full[16:] - want[16:]).abs().max() > 1e-2


def test_batched_decodes_match_hf(gemma3_tiny_dir: Path, hf_lm, ours) -> None:
    """Two sequences past the window decoding in one step (the reference's batched decode path)."""
    a = prompt_ids(gemma3_tiny_dir)
    b = prompt_ids(gemma3_tiny_dir, PROMPT.replace("red car", "blue boat").replace("night", "dawn"))
    kv = allocate_kv_cache(KVCacheSpec.for_model(ours.config, 32, BLOCK, torch.float32), "cpu")
    ta, tb = list(range(0, 16)), list(range(31, 15, -1))
    _run(ours, kv, [(ta, a, 0, len(a) - 2), (tb, b, 0, len(b) - 2)])
    for k in (2, 1):
        got_a, got_b = _run(ours, kv, [(ta, a, len(a) - k, len(a) - k + 1),
                                       (tb, b, len(b) - k, len(b) - k + 1)])
    with torch.no_grad():
        want_a = hf_lm(input_ids=a[None]).logits[0, -1:]
        want_b = hf_lm(input_ids=b[None]).logits[0, -1:]
    torch.testing.assert_close(got_a, want_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_b, want_b, atol=1e-4, rtol=0)


class _NoWindowBackend(AttentionBackend):
    """A backend that cannot mask a window (supports_sliding_window False, the interface's default)."""

    def forward(self, q, k, v, kv_cache, meta, scale, window=None):  # pragma: no cover - never called
        raise AssertionError


def test_kernels_without_window_refused(gemma3_tiny_dir: Path) -> None:
    cfg = TextModelConfig.from_hf(text_config_dict(gemma3_tiny_dir))
    with torch.device("meta"), pytest.raises(ValueError, match="sliding-window layers"):
        LlamaForCausalLM(cfg, _NoWindowBackend())

    class FusedOps:  # an ops class without Gemma's norm
        __name__ = "FusedOps"

    with torch.device("meta"), pytest.raises(ValueError, match="not in FusedOps"):
        LlamaForCausalLM(cfg, TorchAttentionBackend(), FusedOps)
