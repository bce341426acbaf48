"""Which KV heads a tensor-parallel rank holds (decoder_svc/model/parallel.py), checked against HF's
grouped-query rule (`repeat_kv`: q head i reads KV head i // (num_heads / num_kv_heads)): split when there
are at least as many KV heads as ranks, replicated when there are fewer, so that every rank holds the KV
head its own q heads read. Every tiny preset has 2 KV heads and its TP tests run 2 ranks, where both
cases look alike; 4 ranks over 2 KV heads is the replicated case."""

from __future__ import annotations

import pytest

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.parallel import TensorParallel, shard_slices

HEAD_DIM = 8


def _config(heads: int, kv_heads: int) -> TextModelConfig:
    return TextModelConfig(model_type="llama", vocab_size=64, hidden_size=heads * HEAD_DIM,
                           intermediate_size=64, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128)


# (q heads, KV heads, ranks) -> the first KV head of each rank, worked out by hand from HF's rule.
CASES = {
    (4, 2, 4): [0, 0, 1, 1],  # the tiny presets at TP=4: one q head per rank, each KV head on two ranks
    (8, 2, 4): [0, 0, 1, 1],  # two q heads per rank, both reading the same KV head
    (8, 2, 8): [0, 0, 0, 0, 1, 1, 1, 1],
    (8, 1, 4): [0, 0, 0, 0],  # multi-query: the one KV head everywhere
    (8, 4, 2): [0, 2],  # split: two KV heads per rank
    (8, 8, 4): [0, 2, 4, 6],
}


@pytest.mark.parametrize("heads, kv_heads, ranks", list(CASES))
def test_each_rank_holds_the_kv_heads_its_q_heads_read(heads, kv_heads, ranks):
    cfg = _config(heads, kv_heads)
    group = heads // kv_heads  # q heads per KV head (HF's num_key_value_groups)
    q_local = heads // ranks
    for rank in range(ranks):
        tp = TensorParallel(rank, ranks)
        tp.check(cfg)
        local = tp.local_config(cfg)
        start = tp.kv_head_start(cfg)
        assert start == CASES[(heads, kv_heads, ranks)][rank], f"rank {rank}"
        held = range(start, start + local.num_kv_heads)
        # The rank's q heads, and the KV heads HF's rule has them read: all held, in the local grouping.
        q_heads = range(rank * q_local, (rank + 1) * q_local)
        for local_q, q in enumerate(q_heads):
            assert q // group in held, f"rank {rank}: q head {q} reads KV head {q // group}, not held"
            local_group = local.num_heads // local.num_kv_heads
            assert held[local_q // local_group] == q // group
        # The checkpoint rows the rank reads for k and v are those heads' rows.
        for proj in ("k_proj", "v_proj"):
            (rows,) = shard_slices(f"layers.0.self_attn.{proj}.weight", cfg, tp)
            assert (rows.start, rows.stop) == (held.start * HEAD_DIM, held.stop * HEAD_DIM), (rank, proj)
