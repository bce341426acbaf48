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


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int

    def check(self, cfg: TextModelConfig) -> None:
        """CheckpointError when the model's heads or MLP cannot be split over `size` ranks."""
        h, kv = cfg.num_heads, cfg.num_kv_heads
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


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's [rows, vocab slice] logits joined into [rows, vocab_size] (padding dropped)."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def shard_state(state: dict[str, torch.Tensor], cfg: TextModelConfig,
                tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's share of a fused language-model state dict (q/k/v and gate/up already packed).

    The output head is sliced by vocabulary rows: a tied head takes its rows from the embeddings, so the
    result always has its own `lm_head.weight`."""
    h, kv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q_local, kv_local = h // tp.size, max(1, kv // tp.size)
    q0, kv0 = tp.rank * q_local * d, tp.kv_head_start(cfg) * d
    i_local = inter // tp.size
    i0 = tp.rank * i_local
    out = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        leaf = module.rsplit(".", 1)[-1]
        if leaf == "qkv_proj":
            q, k, v = t.split([h * d, kv * d, kv * d], dim=0)
            out[name] = torch.cat([q[q0:q0 + q_local * d], k[kv0:kv0 + kv_local * d],
                                   v[kv0:kv0 + kv_local * d]]).contiguous()
        elif leaf == "gate_up_proj":
            gate, up = t.split([inter, inter], dim=0)
            out[name] = torch.cat([gate[i0:i0 + i_local], up[i0:i0 + i_local]]).contiguous()
        elif leaf in ("o_proj", "down_proj"):
            if kind == "bias":  # added once, after the all-reduce
                out[name] = t if tp.rank == 0 else torch.zeros_like(t)
            else:
                lo, n = (q0, q_local * d) if leaf == "o_proj" else (i0, i_local)
                out[name] = t[:, lo:lo + n].contiguous()
        elif name not in ("lm_head.weight",):
            out[name] = t
    head = state.get("lm_head.weight", state["embed_tokens.weight"])
    rows = tp.vocab_rows(cfg.vocab_size)
    piece = head[tp.rank * rows:(tp.rank + 1) * rows]
    if piece.shape[0] < rows:  # the last slice of a vocabulary that does not divide evenly
        piece = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], piece.shape[1])])
    out["lm_head.weight"] = piece.contiguous()
    return out
