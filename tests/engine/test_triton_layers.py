"""The decoder layers on the Triton kernels (TritonAttentionBackend + TritonOps: the rotary + KV store
kernel, paged attention with split keys, the fused norms and activation) against the same weights on the
torch reference (TorchAttentionBackend + TorchOps), fp32, for the tiny llava, Qwen2.5-VL (M-RoPE) and
Qwen3-VL (QK norms, interleaved M-RoPE) checkpoints: a prompt in two chunks through the paged cache, then
decode steps. The reference path is held to HF elsewhere (tests/engine/test_model.py, the oracles), so
this ties the GPU path's layer wiring to HF on the CPU.

On a CPU host the kernels run in Triton's interpreter (tests/conftest.py); the GPU runs the same wiring
compiled in tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from decoder_svc.model import AttentionMetadata, KVCacheSpec, allocate_kv_cache, load_language_model  # noqa: E402
from decoder_svc.model.kernel_dispatch import (
    TritonAttentionBackend,  # noqa: E402
    TritonOps,  # noqa: E402
)
from decoder_svc.model.llama import LlamaForCausalLM  # noqa: E402

BLOCK = 8


def _steps(model, ids: torch.Tensor, chunks: list[int], decode_steps: int, mrope: bool) -> torch.Tensor:
    """Logits of the last row of each chunk, then of each greedy decode step, through a paged cache whose
    blocks are not in order."""
    spec = KVCacheSpec.for_model(model.config, 16, BLOCK, torch.float32)
    kv = allocate_kv_cache(spec, "cpu")
    table = torch.arange(16).flip(0)[None]
    out, ids, done = [], ids.clone(), 0

    def run(lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        slots = table[0, pos // BLOCK] * BLOCK + pos % BLOCK
        meta = AttentionMetadata.build(slots.tolist(), [hi - lo], [hi], table.tolist(), BLOCK, "cpu")
        # M-RoPE: three position rows that differ (as over an image's tokens), so each token's cos/sin
        # row is gathered from three tables.
        positions = torch.stack([pos, pos + pos % 3, pos + 2 * (pos % 2)]) if mrope else pos
        return model(positions, meta, kv, torch.tensor([hi - lo - 1]), input_ids=ids[lo:hi])

    with torch.no_grad():
        for size in chunks:
            out.append(run(done, done + size))
            done += size
        for _ in range(decode_steps):
            ids = torch.cat([ids[:done], out[-1].argmax(-1)])
            out.append(run(done, done + 1))
            done += 1
    return torch.cat(out)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen_model_dir", "qwen3_model_dir"])
def test_triton_layers_equal_the_reference(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    reference = load_language_model(model_dir)  # CPU: the torch backend and ops
    triton_twin = LlamaForCausalLM(reference.config, TritonAttentionBackend(num_sms=64), TritonOps)
    triton_twin.load_state_dict(reference.state_dict())
    ids = torch.randint(0, reference.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    mrope = reference.uses_mrope
    want = _steps(reference, ids, [13, 8], 3, mrope)
    got = _steps(triton_twin.eval(), ids, [13, 8], 3, mrope)
    assert want.shape == (5, reference.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fixture", ["qwen3_model_dir"])
def test_the_deterministic_kernels_equal_the_reference(fixture: str, request: pytest.FixtureRequest) -> None:
    """The deterministic mode's GPU side (InvariantTritonAttentionBackend + InvariantTritonOps; on a CPU
    the mode's products take MKL's padded path) computes the same model, chunked and decoding."""
    from decoder_svc.model.batch_invariant import invariant_matmuls_active
    from decoder_svc.model.kernel_dispatch import InvariantTritonAttentionBackend, InvariantTritonOps

    model_dir: Path = request.getfixturevalue(fixture)
    reference = load_language_model(model_dir)
    twin = LlamaForCausalLM(reference.config, InvariantTritonAttentionBackend(), InvariantTritonOps)
    twin.load_state_dict(reference.state_dict())
    twin.batch_invariant = True
    ids = torch.randint(0, reference.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    want = _steps(reference, ids, [13, 8], 3, reference.uses_mrope)
    got = _steps(twin.eval(), ids, [13, 8], 3, reference.uses_mrope)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not invariant_matmuls_active()  # the forward's mode ends with it
