"""Tensor parallelism for the language model, Megatron-style, over torch.distributed (gloo on CPU,
NCCL on GPUs).

Each rank holds its share of every layer: the attention heads (q heads split evenly; KV heads split, or
replicated when there are fewer KV heads than ranks), the MLP's hidden columns (gate/up by rows, down by
columns), and a slice of the output head's vocabulary. Two all-reduces per layer (after the attention's
o projection and after the MLP's down projection) and one all-gather of the logits per step; the
embeddings, norms and everything else are replicated. Biases of the row-parallel projections are kept
on rank 0 only, so the all-reduce adds them once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from common.checkpoint import CheckpointError
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.quant.formats import Fp8Format
from decoder_svc.model.quant.fp8 import ScaleBlock, per_channel_block, rows_to_channels


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int

    def check(self, cfg: TextModelConfig) -> None:
        """CheckpointError when the model's heads or MLP cannot be split over `size` ranks (a mixture of
        experts is never split: its experts are not sharded yet)."""
        if cfg.num_experts:
            raise CheckpointError(f"{cfg.model_type}: --tensor-parallel-size {self.size} is not supported "
                                  f"for mixture-of-experts models ({cfg.num_experts} experts per layer are "
                                  "not sharded); serve it with --tensor-parallel-size 1")
        h, kv = cfg.num_heads, cfg.num_kv_heads
        if cfg.linear_layers or cfg.attn_output_gate:
            raise CheckpointError("a hybrid stack (linear-attention layers, gated attention output) is not "
                                  "split over tensor-parallel ranks yet")
        if h % self.size or cfg.intermediate_size % self.size:
            raise CheckpointError(f"{h} attention heads and an MLP of {cfg.intermediate_size} cannot be "
                                  f"split over {self.size} tensor-parallel ranks")
        if kv % self.size and self.size % kv:
            raise CheckpointError(f"{kv} KV heads cannot be split over or replicated on {self.size} ranks")

    def local_config(self, cfg: TextModelConfig) -> TextModelConfig:
        """The shapes this rank's layers have (the vocabulary stays whole: the head is sliced apart)."""
        return replace(cfg, num_heads=cfg.num_heads // self.size,
                       num_kv_heads=max(1, cfg.num_kv_heads // self.size),
                       intermediate_size=cfg.intermediate_size // self.size)

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of this rank's output-head slice (the last ranks' slices are padded with zero rows)."""
        return -(-vocab_size // self.size)

    def kv_head_start(self, cfg: TextModelConfig) -> int:
        """The first KV head this rank holds: the one its first q head reads."""
        q_per_rank = cfg.num_heads // self.size
        return self.rank * q_per_rank // (cfg.num_heads // cfg.num_kv_heads)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns it."""
    dist.all_reduce(x)
    return x


def max_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of x over the ranks, in place; returns it."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's [rows, vocab slice] logits joined into [rows, vocab_size] (padding dropped)."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def shard_slices(name: str, cfg: TextModelConfig, tp: TensorParallel) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` (our names, before q/k/v and gate/up are fused) this rank
    holds; None for a replicated tensor. Row-parallel biases and the output head are handled by
    `finish_shard`, after reading."""
    module, _, kind = name.rpartition(".")
    leaf = module.rsplit(".", 1)[-1]
    h, kv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q_local, kv_local, i_local = h // tp.size, max(1, kv // tp.size), inter // tp.size
    rows = {"q_proj": (tp.rank * q_local * d, q_local * d),
            "k_proj": (tp.kv_head_start(cfg) * d, kv_local * d),
            "v_proj": (tp.kv_head_start(cfg) * d, kv_local * d),
            "gate_proj": (tp.rank * i_local, i_local), "up_proj": (tp.rank * i_local, i_local)}
    cols = {"o_proj": (tp.rank * q_local * d, q_local * d), "down_proj": (tp.rank * i_local, i_local)}
    if leaf in rows and kind in ("weight", "bias"):  # FP8 scales are read whole (shard_fp8_scale)
        lo, n = rows[leaf]
        return (slice(lo, lo + n),)
    if leaf in cols and kind == "weight":
        lo, n = cols[leaf]
        return (slice(None), slice(lo, lo + n))
    if name == "lm_head.weight":
        n = tp.vocab_rows(cfg.vocab_size)
        return (slice(tp.rank * n, (tp.rank + 1) * n),)
    return None


def finish_shard(state: dict[str, torch.Tensor], cfg: TextModelConfig, tp: TensorParallel) -> None:
    """After reading (in place): projections a checkpoint stores fused (Phi-4: qkv_proj, gate_up_proj, read
    whole) cut to this rank's rows of each part, row-parallel biases kept on rank 0 only (the all-reduce
    adds them once), and the output head as this rank's vocabulary slice, padded with zero rows, taken
    from the embeddings when tied (every rank has its own head)."""
    _shard_fused(state, cfg, tp)
    for name in [n for n in state if n.endswith(("o_proj.bias", "down_proj.bias")) and tp.rank]:
        state[name] = torch.zeros_like(state[name])
    n = tp.vocab_rows(cfg.vocab_size)
    head = state.get("lm_head.weight")
    if head is None or cfg.tie_word_embeddings:
        head = state["embed_tokens.weight"][tp.rank * n:(tp.rank + 1) * n]
    if head.shape[0] < n:  # the last slice of a vocabulary that does not divide evenly
        head = torch.cat([head, head.new_zeros(n - head.shape[0], head.shape[1])])
    state["lm_head.weight"] = head.contiguous()


# A checkpoint's own fused projection -> its parts in row order (the names shard_slices knows).
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _shard_fused(state: dict[str, torch.Tensor], cfg: TextModelConfig, tp: TensorParallel) -> None:
    """Fused q|k|v and gate|up tensors (weights, biases) read whole, replaced by this rank's rows of each
    part, concatenated in the same order (our fused modules' layout). A rank's rows of a fused tensor are
    not one range, which the reader's one-slice-per-dim sharding cannot express; these are a few small
    tensors per layer, so they are read whole and cut here."""
    for name in list(state):
        module, _, kind = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        if leaf not in _FUSED_PARTS or kind not in ("weight", "bias"):
            continue
        parts = _FUSED_PARTS[leaf]
        sizes = [_full_dims(p, cfg)[0] for p in parts]
        tensor = state[name]
        if tensor.shape[0] != sum(sizes):
            raise CheckpointError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} "
                                  f"({'+'.join(parts)})")
        pieces = []
        for part, rows in zip(parts, tensor.split(sizes), strict=True):
            pieces.append(rows[shard_slices(f"{prefix}.{part}.{kind}", cfg, tp)[0]])
        state[name] = torch.cat(pieces).contiguous()


def _full_dims(leaf: str, cfg: TextModelConfig) -> tuple[int, int]:
    """(output rows, input columns) of a whole projection or the output head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (cfg.intermediate_size, h), "up_proj": (cfg.intermediate_size, h),
            "down_proj": (h, cfg.intermediate_size), "lm_head": (cfg.vocab_size, h)}[leaf]


def shard_fp8_scale(module: str, scale: torch.Tensor, fmt: Fp8Format, local: tuple[int, int],
                    cfg: TextModelConfig, tp: TensorParallel) -> tuple[torch.Tensor, ScaleBlock]:
    """This rank's scales of an FP8 projection whose weight was read as a slice (`local` [n, k]) and whose
    scales were read whole; cfg is the whole model's config. Rows of a column-parallel weight (and the
    head's vocabulary slice) keep their scale blocks where the slice starts and ends on block edges, else
    get one scale row per weight row (exact, as align_shard_blocks does for fused shards). Columns of a
    row-parallel weight keep per-channel scales whole and block scales sliced; a slice that cuts through
    a column block is refused (as vLLM refuses it)."""
    slices = shard_slices(f"{module}.weight", cfg, tp)
    if slices is None:
        return fmt.scale_block(scale, *local)
    n_full, k_full = _full_dims(module.rsplit(".", 1)[-1], cfg)
    scale, block = fmt.scale_block(scale, n_full, k_full)
    if len(slices) == 1:  # rows [lo, hi)
        lo, hi = slices[0].start, slices[0].stop
        if hi <= n_full and lo % block.rows == 0 and (hi % block.rows == 0 or hi == n_full):
            return scale[lo // block.rows: -(-hi // block.rows)], block
        rows = rows_to_channels(scale, block, n_full)[lo:hi]
        pad = local[0] - rows.shape[0]  # the head's last slice, padded with zero rows by finish_shard
        return torch.cat([rows, rows.new_ones(pad, rows.shape[1])]), ScaleBlock(1, block.cols)
    lo, hi = slices[1].start, slices[1].stop  # columns [lo, hi)
    if block.is_per_channel(k_full):
        return scale, per_channel_block(hi - lo)
    if lo % block.cols or (hi % block.cols and hi != k_full):
        raise CheckpointError(f"{module}: {k_full} input columns split over {tp.size} ranks ({hi - lo} each) "
                              f"cut through the checkpoint's {block.cols}-column scale blocks; serve it with "
                              "fewer tensor-parallel ranks")
    return scale[:, lo // block.cols: -(-hi // block.cols)], block
