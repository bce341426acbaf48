"""decoder_svc/model/gated_deltanet.py against HF's Qwen3_5GatedDeltaNet (its torch fallback, fp32 CPU): the
whole-sequence output bit-equal to HF's layer; a prefill, decode steps and a later chunk bit-equal to HF's
cached run (what `generate` does), states included; and a sequence cut anywhere (inside a 64-token chunk
too) and continued from the carried state equal to the whole up to the rounding of another chunking."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.model.gated_deltanet import (
    CHUNK_SIZE,
    GatedDeltaNet,
    GatedDeltaNetShape,
    GatedDeltaNetState,
)

# q/k heads serve 2 value heads each (as the 9B's 16 / 32); widths small enough for a CPU
TEXT = dict(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
# Cut elsewhere, the chunked rule sums in other orders (and the recurrent form in others still): outputs of
# size up to ~4 agree to ~2e-5 (measured); a lost or wrong state is off by ~0.1 or more.
ATOL = 5e-5


def _hf_layer(seed: int = 0):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, **TEXT)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # scale so that every term matters: decays of all speeds, gates open and shut
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if "conv" not in name else 0.5)
        layer.dt_bias.normal_(0.0, 1.0)
        layer.norm.weight.normal_(1.0, 0.1)
    return config, layer


def _ours(hf_layer) -> GatedDeltaNet:
    layer = GatedDeltaNet(GatedDeltaNetShape.from_text_config(TEXT)).eval()
    layer.load_state_dict(hf_layer.state_dict(), strict=True)  # the checkpoints' parameter names
    return layer


def _x(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, TEXT["hidden_size"], generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_shapes_of_the_state():
    shape = GatedDeltaNetShape.from_text_config(TEXT)
    assert shape.conv_dim == 2 * 2 * 16 + 4 * 8 == 96
    state = GatedDeltaNetState.zeros(shape, 3, torch.bfloat16)
    assert state.conv.shape == (3, 96, 3) and state.conv.dtype == torch.bfloat16  # the last K - 1 inputs
    # [B, Hv, Dk, Dv], fp32 whatever the activations' dtype
    assert state.recurrent.shape == (3, 4, 16, 8) and state.recurrent.dtype == torch.float32
    assert shape.state_nbytes(torch.bfloat16) == 96 * 3 * 2 + 4 * 16 * 8 * 4
    nine_b = GatedDeltaNetShape(4096, 16, 32, 128, 128, 4)
    assert nine_b.conv_state_shape(1) == (1, 8192, 3) and nine_b.recurrent_state_shape(1) == (1, 32, 128, 128)
    with pytest.raises(ValueError, match="not a multiple"):
        GatedDeltaNetShape(48, 3, 4, 16, 8, 4)


def _hf_cached(config, hf, pieces: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """HF's layer over consecutive pieces of a sequence through its DynamicCache (generate's path):
    the outputs, and the cache's layer after the last."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    return [hf(piece, cache=cache) for piece in pieces], cache.layers[0]


@torch.no_grad()
@pytest.mark.parametrize("length", [1, 3, 5, CHUNK_SIZE, 150])
def test_whole_sequence_is_hf_s_bit_for_bit(length):
    config, hf = _hf_layer()
    ours = _ours(hf)
    x = _x(2, length)
    out, state = ours(x)
    (cached,), layer = _hf_cached(config, hf, [x])
    assert torch.equal(out, cached)  # generate's path
    if length > 1:  # HF's uncached layer too (for one token its two paths differ from each other, ~1e-7)
        assert torch.equal(out, hf(x))
    assert torch.equal(state.recurrent, layer.recurrent_states[0])
    assert torch.equal(state.conv, layer.conv_states[0][:, :, 1:])  # HF keeps K columns, we the last K - 1


@torch.no_grad()
@pytest.mark.parametrize("prefill", [1, 3, 30, CHUNK_SIZE - 1, CHUNK_SIZE, 100])
def test_prefill_decode_steps_and_a_later_chunk_equal_hf_s_cached_run(prefill):
    """generate's order: a prefill, tokens one at a time (`step`), then a chunk from the carried state."""
    config, hf = _hf_layer()
    ours = _ours(hf)
    x = _x(2, 150)
    cuts = [prefill + i for i in range(11)]
    pieces = [x[:, a:b] for a, b in zip([0, *cuts], [*cuts, 150], strict=True)]
    refs, layer = _hf_cached(config, hf, pieces)
    out, state = ours(pieces[0])
    outs = [out]
    for piece in pieces[1:-1]:
        out, state = ours.step(piece, state)
        outs.append(out)
    out, state = ours(pieces[-1], state)
    outs.append(out)
    for mine, ref in zip(outs, refs, strict=True):
        assert torch.equal(mine, ref)
    assert torch.equal(state.recurrent, layer.recurrent_states[0])
    assert torch.equal(state.conv, layer.conv_states[0][:, :, 1:])


@torch.no_grad()
@pytest.mark.parametrize("cut", [1, 3, 17, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 5, 129])
def test_a_cut_anywhere_continued_from_the_state_equals_the_whole(cut):
    _, hf = _hf_layer()
    ours = _ours(hf)
    x = _x(2, 150)
    whole, whole_state = ours(x)
    first, state = ours(x[:, :cut])
    second, end = ours(x[:, cut:], state)  # a second prefill chunk
    assert torch.allclose(torch.cat([first, second], 1), whole, atol=ATOL, rtol=0)
    assert torch.allclose(end.recurrent, whole_state.recurrent, atol=ATOL, rtol=0)
    assert torch.equal(end.conv, whole_state.conv)  # the last K - 1 inputs, whoever computed them
    # the same cut, then recurrent steps for the next 6 tokens, then a chunk for the rest
    steps = []
    for t in range(cut, cut + 6):
        out, state = ours.step(x[:, t:t + 1], state)
        steps.append(out)
    rest, end = ours(x[:, cut + 6:], state)
    assert torch.allclose(torch.cat([first, *steps, rest], 1), whole, atol=ATOL, rtol=0)
    assert torch.allclose(end.recurrent, whole_state.recurrent, atol=ATOL, rtol=0)


@torch.no_grad()
def test_the_state_passed_in_is_not_modified_and_matters():
    _, hf = _hf_layer()
    ours = _ours(hf)
    x = _x(1, 20)
    _, state = ours(x[:, :10])
    kept = GatedDeltaNetState(state.conv.clone(), state.recurrent.clone())
    carried, _ = ours(x[:, 10:], state)
    assert torch.equal(state.conv, kept.conv) and torch.equal(state.recurrent, kept.recurrent)
    fresh, _ = ours(x[:, 10:])
    assert not torch.allclose(carried, fresh, atol=1e-3)  # a test the state would fail without it
    # each sequence of a batch keeps its own state
    both, _ = ours(torch.cat([x[:, 10:], x[:, 10:]]), GatedDeltaNetState(
        torch.cat([state.conv, torch.zeros_like(state.conv)]),
        torch.cat([state.recurrent, torch.zeros_like(state.recurrent)])))
    # (a batch of two rounds its products otherwise than a batch of one: a few ulps)
    assert torch.allclose(both[0], carried[0], atol=1e-6, rtol=0)
    assert torch.allclose(both[1], fresh[0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_the_tiny_checkpoint_s_layers_under_generate(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    """Each linear layer of the tiny checkpoint, loaded by its checkpoint names, fed what HF's layer was fed
    during a greedy `generate` with an image (the prefill, then one token a step), gives HF's outputs bit
    for bit, its state carried from call to call."""
    from safetensors.torch import load_file

    from common.families.qwen3_5.oracle import IMAGE_PAD

    text = qwen3_5_oracle.model.config.text_config.to_dict()
    weights = load_file(str(qwen3_5_model_dir / "model.safetensors"))
    hf_layers = qwen3_5_oracle.model.model.language_model.layers
    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    hooks = []
    for i, kind in enumerate(text["layer_types"]):
        if kind == "linear_attention":
            def record(module, args, kwargs, out, i=i):
                calls.setdefault(i, []).append((kwargs["hidden_states"].clone(), out.clone()))
            hooks.append(hf_layers[i].linear_attn.register_forward_hook(record, with_kwargs=True))
    try:
        prompt = f"<|im_start|>user\n<|vision_start|>{IMAGE_PAD}<|vision_end|>what?<|im_end|>\n"
        qwen3_5_oracle.generate(prompt, qwen_images[:1], 6)
    finally:
        for hook in hooks:
            hook.remove()
    shape = GatedDeltaNetShape.from_text_config(text)
    assert sorted(calls) == [0, 1, 2] and all(len(c) == 6 for c in calls.values())  # prefill + 5 steps
    for i, layer_calls in calls.items():
        prefix = f"model.language_model.layers.{i}.linear_attn."
        layer = GatedDeltaNet(shape).eval()
        layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
        (x, ref), *steps = layer_calls
        assert x.shape[1] > 64  # the image's tokens and the text: more than one chunk
        out, state = layer(x)
        assert torch.equal(out, ref)
        for x, ref in steps:
            out, state = layer.step(x, state)
            assert torch.equal(out, ref)
