"""fla's varlen chunk indices given ahead (decoder_svc/model/fla_indices.py): the seeded results equal fla
0.4's helpers' formulas, the wrappers answer a seeded cu_seqlens tensor (by identity) without calling
fla's helper and call it for any other, and a step's device plan seeds every round's cu_seqlens."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from decoder_svc.model import fla_indices
from decoder_svc.model.gated_deltanet_fla import FLA_CHUNK, _device_plan
from decoder_svc.model.linear_state import LinearChunk


def fla_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla 0.4's prepare_chunk_indices (fla/ops/utils/index.py), restated."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    indices = torch.cat([torch.arange(n) for n in (-(-lengths // chunk_size)).tolist()])
    return torch.stack([indices.eq(0).cumsum(0) - 1, indices], 1).to(cu_seqlens)


def fla_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla 0.4's prepare_chunk_offsets, restated."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.cat([cu_seqlens.new_tensor([0]), -(-lengths // chunk_size)]).cumsum(-1)


@pytest.mark.parametrize("lengths", [[1], [64], [65, 3, 128], [2, 1024, 512, 1]])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_host_results_equal_fla_s(lengths, chunk_size):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    assert torch.equal(torch.tensor(fla_indices.chunk_indices(lengths, chunk_size)).view(-1, 2),
                       fla_chunk_indices(cu, chunk_size))
    assert torch.equal(torch.tensor(fla_indices.chunk_offsets(lengths, chunk_size)),
                       fla_chunk_offsets(cu, chunk_size))


@pytest.fixture
def fake_fla(monkeypatch):
    """A fake fla package whose modules import the two helpers by name, as fla's do; the helpers count
    their calls (each one would read cu_seqlens back to the host)."""
    calls = []

    def prepare_chunk_indices(cu_seqlens, chunk_size):
        calls.append("indices")
        return fla_chunk_indices(cu_seqlens, chunk_size)

    def prepare_chunk_offsets(cu_seqlens, chunk_size):
        calls.append("offsets")
        return fla_chunk_offsets(cu_seqlens, chunk_size)

    modules = {}
    for name in ("fakefla.ops.utils.index", "fakefla.ops.common.chunk_delta_h", "fakefla.ops.common.chunk_o"):
        module = types.ModuleType(name)
        module.prepare_chunk_indices = prepare_chunk_indices
        module.prepare_chunk_offsets = prepare_chunk_offsets
        monkeypatch.setitem(sys.modules, name, module)
        modules[name] = module
    monkeypatch.setattr(fla_indices, "_seeded", type(fla_indices._seeded)())
    return modules, calls


def test_wrappers_answer_seeded_tensors_and_defer_others(fake_fla):
    modules, calls = fake_fla
    assert fla_indices.install("fakefla.") == 6
    assert fla_indices.install("fakefla.") == 0  # already pointed
    cu = torch.tensor([0, 70, 73])
    seeded_indices = torch.tensor(fla_indices.chunk_indices([70, 3], 64)).view(-1, 2)
    seeded_offsets = torch.tensor(fla_indices.chunk_offsets([70, 3], 64))
    fla_indices.seed(cu, seeded_indices, seeded_offsets, 64)
    for module in modules.values():
        assert module.prepare_chunk_indices(cu, 64) is seeded_indices
        assert module.prepare_chunk_offsets(cu, 64) is seeded_offsets
    assert calls == []
    same_values = cu.clone()  # another tensor: fla's own helper, as before
    assert torch.equal(modules["fakefla.ops.common.chunk_o"].prepare_chunk_indices(same_values, 64),
                       seeded_indices)
    modules["fakefla.ops.common.chunk_o"].prepare_chunk_indices(cu, 16)  # another chunk size
    assert calls == ["indices", "indices"]


def test_a_step_s_plan_seeds_every_round(fake_fla):
    modules, calls = fake_fla
    fla_indices.install("fakefla.")
    chunks = (LinearChunk(0, 150, 0, True, ((64, 3), (128, 4))), LinearChunk(150, 152, 1, False),
              LinearChunk(152, 300, 2, False, ((100, 5),)))
    for conv_kernel in (True, False):
        plan = _device_plan(chunks, 4, torch.device("cpu"), conv_kernel)
        assert len(plan.rounds) == 3
        helpers = modules["fakefla.ops.common.chunk_delta_h"]
        for rnd in plan.rounds:
            assert torch.equal(helpers.prepare_chunk_indices(rnd.cu_seqlens, FLA_CHUNK),
                               fla_chunk_indices(rnd.cu_seqlens, FLA_CHUNK))
            assert torch.equal(helpers.prepare_chunk_offsets(rnd.cu_seqlens, FLA_CHUNK),
                               fla_chunk_offsets(rnd.cu_seqlens, FLA_CHUNK))
        assert calls == []
        # only the indices of the convolution that runs are built and sent
        kernel_side = (plan.codes, plan.window_codes, plan.window_dsts)
        windows = [rnd.windows for rnd in plan.rounds if rnd.dsts is not None]
        torch_side = (plan.columns, plan.conv_out, *windows)
        assert all((t is not None) == conv_kernel for t in kernel_side)
        assert all((t is not None) != conv_kernel for t in torch_side)
