"""The Triton vision attention kernel (common/kernels/vision_attention.py) stays inside its tensors, run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host).

On an H100 the kernel gave NaN in the head-dim tail and an illegal address on layouts with spans shorter
than the key block; its loads then formed addresses past a span, past the tensor's end and past the head
dim (in masked-off lanes), which the interpreter, honouring masks, never showed. Here every launch runs
under `MemoryWatch`, which wraps the interpreter's loads and stores (Triton 3.6's InterpreterBuilder and
GridExecutor):

- every address a load or a store forms, masked-off lanes included, must be an element of one of the
  launch's tensors (a store: of `Out`); not past the tensor's end, not in the padding after a head dim
  of 72 stored with a row stride of 80;
- masked-off lanes inside the poisoned buffers read what is there (NaN), as a GPU whose code drops or
  hoists a mask would: no result may depend on a masked load's `other`.

q, k, v are views into NaN-filled buffers (padded head dims and rows after the last span, or contiguous
tensors followed by NaN rows), the output starts as NaN, and the result must equal
F.scaled_dot_product_attention per span in fp32, with no NaN. Spans of 1, 2, 17, 63, 64 and 65 rows (the
key block is 64), empty ones among them; head dims 72 and 80; with and without the host's block map;
every block shape the tile table, the GPU tests and the benchmark's sweep launch; and the key blocks after
the loop's end that a pipelined loop (num_stages > 1) loads ahead. The interpreter runs one program at a
time, so warps and stages change nothing else here: on the device, tests/gpu/test_vision_attention.py
and `python -m bench.experiments.vision_attention_nan`."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from common.kernels import vision_attention as va  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")

LAYOUTS = {
    "one_row": [0, 1],
    "ones": [0, 1, 2, 3],
    "two": [0, 2],
    "seventeen": [0, 17],
    "63_64_65": [0, 63, 127, 192],
    "mixed": [0, 1, 3, 20, 20, 83, 147, 212],  # 1, 2, 17, an empty span, 63, 64, 65
    "exact": [0, 64, 128],  # no partial key block: the head-dim tail alone
    "long_last": [0, 5, 150],  # 128-row query blocks; full key blocks, then a partial one at the end
}

# (block_m, block_n) of tiles_for, tests/gpu and bench/vision_attention.py's sweep, and a small one.
BLOCKS = [(64, 64), (128, 64), (128, 32), (64, 32), (128, 128), (64, 128), (32, 16)]

ROOM = 256  # NaN rows after the real ones: more than a query block past the last row


class MemoryWatch:
    """The addresses of every load and store of the launches made while installed (see the module's doc)."""

    def __init__(self) -> None:
        self.written = ("Out",)  # the parameters a kernel may store into
        self.arenas: list[tuple[int, int]] = []  # [first byte, end) of each poisoned buffer
        self.readable = np.empty(0, dtype=np.uint64)
        self.writable = np.empty(0, dtype=np.uint64)
        self.loads = self.stores = 0
        self.violations: list[str] = []

    def poison(self, *buffers: torch.Tensor) -> None:
        for buf in buffers:
            self.arenas.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))

    def launched(self, tensors: dict[str, torch.Tensor]) -> None:
        """The kernel's tensor arguments, by parameter name, as the interpreter will address them."""
        self.readable = np.unique(np.concatenate([element_addresses(t) for t in tensors.values()]))
        written = [element_addresses(tensors[name]) for name in self.written]
        self.writable = np.unique(np.concatenate([np.empty(0, dtype=np.uint64), *written]))

    def in_arena(self, addresses: np.ndarray, itemsize: int) -> np.ndarray:
        inside = np.zeros(addresses.shape, dtype=bool)
        for first, end in self.arenas:
            inside |= (addresses >= first) & (addresses + itemsize <= end)
        return inside

    def check(self, kind: str, addresses: np.ndarray, mask: np.ndarray, allowed: np.ndarray) -> None:
        if allowed.size:
            outside = allowed[np.minimum(np.searchsorted(allowed, addresses), allowed.size - 1)] != addresses
        else:
            outside = np.ones(addresses.shape, dtype=bool)
        if outside.any():
            self.violations.append(f"{kind} of {addresses.shape}: {int(outside.sum())} addresses outside the "
                                   f"tensors, {int((outside & ~mask).sum())} of them in masked-off lanes")


def element_addresses(t: torch.Tensor) -> np.ndarray:
    """The first byte of every element of t (any strides)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (t.data_ptr() + offsets.flatten().numpy() * t.element_size()).astype(np.uint64)


@pytest.fixture
def watch(monkeypatch) -> Iterator[MemoryWatch]:
    seen = MemoryWatch()
    init_args = interpreter.GridExecutor._init_args_hst
    masked_load = interpreter.InterpreterBuilder.create_masked_load
    masked_store = interpreter.InterpreterBuilder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        named = dict(zip(self.arg_names, args_hst, strict=False)) | kwargs_hst
        seen.launched({name: arg for name, arg in named.items() if isinstance(arg, torch.Tensor)})
        return args_hst, kwargs_hst

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        addresses = ptrs.data.astype(np.uint64)
        seen.loads += 1
        seen.check("load", addresses, mask.data, seen.readable)
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        leak = ~mask.data & seen.in_arena(addresses, itemsize)
        if leak.any():  # a masked-off lane reads the poison its address holds
            mask = interpreter.TensorHandle(mask.data | leak, mask.dtype)
        return masked_load(self, ptrs, mask, other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        seen.stores += 1
        seen.check("store", ptrs.data.astype(np.uint64), mask.data, seen.writable)
        return masked_store(self, ptrs, value, mask, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", init_args_hst)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", create_masked_load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", create_masked_store)
    yield seen


def poisoned_inputs(tokens: int, heads: int, head_dim: int, packing: str,
                    seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """([q, k, v], [buffers]): q, k, v of `tokens` real rows inside NaN-filled buffers. "qkv": views of one
    [tokens + ROOM, 3, heads, head_dim + 8] product (the padding dims and the rows after are NaN); "separate":
    three contiguous tensors, each followed by ROOM rows of NaN."""
    gen = torch.Generator().manual_seed(seed)
    real = torch.randn(tokens, 3, heads, head_dim, generator=gen) * 2
    if packing == "qkv":
        buf = torch.full((tokens + ROOM, 3, heads, head_dim + 8), float("nan"))
        buf[:tokens, :, :, :head_dim] = real
        return list(buf[:tokens, :, :, :head_dim].unbind(1)), [buf]
    bufs = [torch.full(((tokens + ROOM) * heads * head_dim,), float("nan")) for _ in range(3)]
    views = [b[:tokens * heads * head_dim].view(tokens, heads, head_dim) for b in bufs]
    for i, view in enumerate(views):
        view.copy_(real[:, i])
    return views, bufs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
              scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention of each span alone, fp32; rows outside every span stay 0."""
    out = torch.zeros(q.shape)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            span = [t[a:b].float().transpose(0, 1) for t in (q, k, v)]  # [heads, len, D]
            out[a:b] = F.scaled_dot_product_attention(*span, scale=scale).transpose(0, 1)
    return out


def attend_under_watch(watch: MemoryWatch, monkeypatch, bounds: list[int], head_dim: int, use_map: bool,
                       tiles: va.Tiles | None = None, packing: str = "qkv") -> None:
    (q, k, v), buffers = poisoned_inputs(bounds[-1], 2, head_dim, packing, seed=head_dim + len(bounds))
    watch.poison(*buffers)
    assert torch.isnan(buffers[0]).any() and not torch.isnan(q).any()
    empty = torch.empty
    monkeypatch.setattr(va.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    max_len = int(np.diff(bounds).max())
    block_m = tiles.block_m if tiles else va.block_m_for(max_len)
    block_map = torch.from_numpy(va.make_block_map(bounds, block_m)) if use_map else None
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = va.varlen_attention(q, k, v, cu, max_len, head_dim**-0.5, block_map=block_map, tiles=tiles)
    monkeypatch.setattr(va.torch, "empty", empty)
    assert watch.loads and watch.stores  # the watch saw the launch
    assert not watch.violations, watch.violations[:4]
    nan_dims = torch.isnan(got).any(0).any(0).nonzero().flatten().tolist()
    assert not nan_dims, f"NaN at head dims {nan_dims}"
    assert (got - reference(q, k, v, bounds, head_dim**-0.5)).abs().max().item() < 5e-5


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("use_map", [True, False], ids=["map", "grid"])
def test_default_tiles_stay_inside_the_tensors(watch, monkeypatch, layout, head_dim, use_map):
    attend_under_watch(watch, monkeypatch, LAYOUTS[layout], head_dim, use_map)


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_block_shape_stays_inside_the_tensors(watch, monkeypatch, blocks, head_dim):
    attend_under_watch(watch, monkeypatch, LAYOUTS["mixed"], head_dim, True, tiles=va.Tiles(*blocks, 4, 2))


@pytest.mark.parametrize("head_dim", [16, 40, 64, 100])
def test_other_head_dims_stay_inside(watch, monkeypatch, head_dim):
    """No tail (16, 64), a tail window overlapping the main part by 8 (40) and by 28 dims (100)."""
    attend_under_watch(watch, monkeypatch, LAYOUTS["mixed"], head_dim, True)


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("layout", ["one_row", "mixed"])
def test_separate_contiguous_tensors_stay_inside(watch, monkeypatch, layout, head_dim):
    """q, k, v contiguous, each followed by NaN: the last row's last head ends the tensor, so a head-dim tail
    read past dim 72 (or a row past the last) leaves it."""
    attend_under_watch(watch, monkeypatch, LAYOUTS[layout], head_dim, True, packing="separate")


@triton.jit
def _blocks_after_the_loop(K, V, length, stride_t, extra, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
                           TAIL_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The loads a pipelined loop issues ahead of its last full block: the kernel's key-block step at the
    `extra` starts after it (their results unused, as the pipeliner drops them)."""
    q0 = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    q1 = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_full = (length // BLOCK_N) * BLOCK_N
    for i in range(extra):
        va._kv_block(q0, q1, m_i, l_i, q0, q1, K, V, stride_t, stride_t, n_full + i * BLOCK_N, length, 1.0,
                     D_MAIN, D_TAIL, TAIL_FIRST, BLOCK_N, False, "ieee")


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("length", [1, 17, 64, 65])
def test_blocks_a_pipelined_loop_prefetches_stay_inside(watch, length, head_dim):
    """With num_stages > 1 the compiled loop loads the next stages' key blocks before it knows the loop
    ends; those blocks start past the span (and here past the tensor): their rows must stay inside."""
    (_, k, v), buffers = poisoned_inputs(length, 1, head_dim, "separate", seed=length)
    watch.poison(*buffers)
    watch.written = ()
    constants = va.kernel_constants(head_dim, va.Tiles(64, 64, 4, 3), True, "ieee", 1)
    _blocks_after_the_loop[(1,)](k, v, length, k.stride(0), 2, D_MAIN=constants["D_MAIN"],
                                 D_TAIL=constants["D_TAIL"], TAIL_FIRST=constants["TAIL_FIRST"], BLOCK_M=16,
                                 BLOCK_N=64)
    assert watch.loads == 2 * 4  # two blocks of k and v, main dims and tail
    assert not watch.violations, watch.violations[:4]


@triton.jit
def _copy(X, Y, n, BLOCK: tl.constexpr):
    """Y[:BLOCK] = X[:n] and `other` (0) after: the lanes past n are masked off on the load only."""
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n, other=0.0))


def test_the_watch_sees_a_masked_read_past_the_tensor(watch):
    """The harness itself: a masked-off load past its tensor's end is reported and reads the poison there."""
    buf = torch.full((16,), float("nan"))
    buf[:5] = 1.0
    x, y = buf[:5], torch.zeros(8)
    watch.poison(buf)
    watch.written = ("Y",)
    _copy[(1,)](x, y, 5, BLOCK=8)
    assert watch.loads == 1 and watch.stores == 1
    assert watch.violations == ["load of (8,): 3 addresses outside the tensors, 3 of them in masked-off "
                                "lanes"]
    assert y[:5].eq(1).all() and y[5:].isnan().all()
