"""KV cache groups: layers that share an attention pattern share a block pool and block tables.

A model whose layers all attend to the whole sequence has one group (every layer, one pool): the cache
is what it always was. Gemma 3 interleaves sliding-window layers (keys within `sliding_window` of the
query) with full ones: the full layers form group 0 and the sliding layers with one window form another.
A sliding group keeps only the blocks its window can still see (engine/sliding_block_manager.py), so
its pool can be far smaller than the full group's for the same requests.

Pool split (`split_kv_blocks`): the byte budget is first counted as `total` blocks of every layer, as
for a one-group model. A sliding group never holds more than a request's window plus its largest chunk
per running request: `max_num_seqs * (ceil((window + max_tokens) / block_size) + 2)` blocks (a request
holds the blocks from the one containing position start - window + 1 up to its chunk's end, and keeps
them until its next chunk), and never more than the full group holds for the same requests. So it gets
min(that bound, the full group's count), and the full group takes the bytes left (up to what every
sequence at full length would use). Each sliding pool has
one more physical block, the null block 0, which stands in the tables for freed entries (never written:
its zeros are finite, and every key it stands for is masked).
"""

from __future__ import annotations

from dataclasses import dataclass

from decoder_svc.model.config import TextModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one attention pattern (`window` None: full attention) and their pool's block count
    (null block excluded; a sliding group's tensors hold num_blocks + 1 blocks, block 0 the null one)."""

    layers: tuple[int, ...]
    window: int | None
    num_blocks: int = 0

    @property
    def num_physical_blocks(self) -> int:
        """Blocks of the group's KV tensors: the pool, plus the null block for a sliding group."""
        return self.num_blocks + (self.window is not None)


def layer_groups(cfg: TextModelConfig) -> list[KVCacheGroup]:
    """The model's groups without sizes: full layers first (group 0), then one group per window. A hybrid
    stack's linear-attention layers keep no KV (a state each: model/linear_state.py): in no group."""
    by_window: dict[int | None, list[int]] = {}
    for i in cfg.attention_layers:
        by_window.setdefault(cfg.layer_window(i), []).append(i)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(tuple(by_window[w]), w) for w in order]


def group_of_layer(groups: list[KVCacheGroup], num_layers: int) -> list[int]:
    """Each layer's group index."""
    out = [0] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layers:
            out[layer] = g
    return out


def sliding_bound(window: int, block_size: int, max_num_seqs: int, max_tokens: int) -> int:
    """The most blocks a sliding group's requests can hold at once (see the module's docstring)."""
    return max_num_seqs * (-(-(window + max_tokens) // block_size) + 2)


def split_kv_blocks(groups: list[KVCacheGroup], total: int, block_size: int, max_num_seqs: int,
                    max_tokens: int, max_blocks: int | None = None) -> list[KVCacheGroup]:
    """The groups with their block counts, out of the bytes of `total` blocks of every layer; no group
    gets more than `max_blocks` (every sequence at full length: more would never be used)."""
    if len(groups) == 1:
        return [KVCacheGroup(groups[0].layers, groups[0].window, total)]
    num_layers = sum(len(g.layers) for g in groups)
    bounds = [sliding_bound(g.window, block_size, max_num_seqs, max_tokens) if g.window else None
              for g in groups]
    full_layers = sum(len(g.layers) for g, b in zip(groups, bounds, strict=True) if b is None)
    if full_layers == 0:  # windows everywhere: nothing to give the bytes to; share them evenly
        full = total
    else:
        sliding_bytes = sum(len(g.layers) * b for g, b in zip(groups, bounds, strict=True) if b is not None)
        full = max(total, (total * num_layers - sliding_bytes) // full_layers)
    if max_blocks is not None:
        full = min(full, max(max_blocks, total))
    return [KVCacheGroup(g.layers, g.window, full if b is None else min(b, full))
            for g, b in zip(groups, bounds, strict=True)]
