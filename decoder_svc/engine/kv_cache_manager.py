"""KV blocks over the model's KV cache groups (model/kv_groups.py): one pool per group, one interface.

A model without sliding-window layers has one group, a plain BlockManager: block ids, stats and
behaviour are that pool's. Gemma 3 adds a sliding group (engine/sliding_block_manager.py) whose requests
hold only their window's blocks. The scheduler sees one manager and one rule; the manager keeps the
groups in step:

- a prefix hit of k blocks needs the full groups' blocks 0..k-1 and, in each sliding group, the blocks a
  query at k * block_size can see; the largest k every group can serve wins (each sliding group scans
  from the right; a smaller k may need other sliding blocks, so the groups are asked again until they
  agree). The hit never covers the last token.
- an allocation first drops each sliding group's blocks that left the window (always safe: the
  request's next query is at num_computed_tokens or later), then checks that every group can supply its
  blocks before it takes any, so a failure changes nothing.
- stats are summed over the groups (zero used blocks means zero in every group); `group_stats` has each,
  `group_rows` each with its name and window (the API's DecoderStats.kv_groups).

A hybrid stack (linear-attention layers beside attention ones) also needs a state slot per running
request (`state_slots`, engine/state_slots.py): an allocation that would admit a request fails, taking
nothing, when no slot is free, and `free` gives the slot back with the blocks. A linear layer's state
after a prefix is in no block, so a KV hit alone cannot resume it: a hit is cut back to the longest
prefix that also has a snapshot of that state at its end (`snapshots`, engine/state_snapshots.py), and
admitting it queues the copy of the snapshot into the request's slot (`take_state_copies`, run before
the step's forward). Without snapshots prefix reuse is off. A fork (n samples) copies the parent's
state into the child's slot the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoder_svc.engine.block_manager import BlockManager, BlockStats, KVBlock
from decoder_svc.engine.request import Request
from decoder_svc.engine.sliding_block_manager import SlidingWindowBlockManager
from decoder_svc.engine.state_slots import StateSlots
from decoder_svc.engine.state_snapshots import StateSnapshots
from decoder_svc.model.kv_groups import KVCacheGroup


@dataclass(frozen=True)
class KvGroupStats:
    """One group's pool as the API's KvGroupStats reports it (a DecoderStats.kv_groups row)."""

    name: str  # "full", or "sliding_<window>"
    window: int  # tokens; 0 for full attention
    blocks_used: int
    blocks_total: int
    blocks_cached_free: int


@dataclass
class PrefixHit:
    """A prefix hit: each group's table entries for its first `len()` blocks (the same count in all), and
for a hybrid stack the key of the state snapshot at its end."""

    tables: list[list[KVBlock]] = field(default_factory=list)
    snapshot: bytes | None = None

    def __len__(self) -> int:
        return len(self.tables[0]) if self.tables else 0


class KVCacheManager:
    """Allocates KV blocks in every group's pool and reuses cached prefixes across them."""

    def __init__(self, pools: list[BlockManager], state_slots: StateSlots | None = None,
                 snapshots: StateSnapshots | None = None) -> None:
        """`state_slots`, `snapshots`: a hybrid stack's (None for a stack of attention layers only)."""
        if not pools or len({p.block_size for p in pools}) != 1:
            raise ValueError("one or more pools, all of one block size")
        if state_slots is not None and snapshots is None and any(p.enable_prefix_caching for p in pools):
            raise ValueError("prefix reuse over a linear layer's state needs its snapshots")
        if state_slots is not None and any(isinstance(p, SlidingWindowBlockManager) for p in pools):
            raise ValueError("linear-attention layers beside sliding-window ones are not served")
        self.pools = pools
        self.state_slots = state_slots
        self.snapshots = snapshots
        self._restores: list[tuple[int, int]] = []  # (snapshot slot, request slot) before the next step
        self.block_size = pools[0].block_size
        self.enable_prefix_caching = pools[0].enable_prefix_caching
        shared: dict[str, list[bytes]] = pools[0]._req_hashes
        for pool in pools[1:]:  # block hashes do not depend on the group: computed once
            pool._req_hashes = shared
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hit_tokens_by_adapter: dict[str, int] = {}

    @classmethod
    def for_groups(cls, groups: list[KVCacheGroup] | tuple[KVCacheGroup, ...], block_size: int,
                   enable_prefix_caching: bool = True, num_state_slots: int = 0, num_snapshots: int = 0,
                   snapshot_interval: int = 64, snapshot_bytes: int = 0) -> KVCacheManager:
        """A pool per group: a BlockManager for full attention, a SlidingWindowBlockManager per window.
        `num_state_slots` > 0 (a hybrid stack): that many state slots, then `num_snapshots` snapshot slots
        of `snapshot_bytes` each, taken every `snapshot_interval` blocks (and at image ends); prefix reuse
        only with snapshots."""
        slots = StateSlots(num_state_slots) if num_state_slots else None
        snapshots = None
        if slots is not None and num_snapshots and enable_prefix_caching:
            snapshots = StateSnapshots(num_snapshots, num_state_slots, snapshot_interval, snapshot_bytes)
        reuse = enable_prefix_caching and (slots is None or snapshots is not None)
        return cls([BlockManager(g.num_blocks, block_size, reuse) if g.window is None else
                    SlidingWindowBlockManager(g.num_blocks, g.window, block_size, reuse)
                    for g in groups], slots, snapshots)

    # -- prefix lookup ---------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest prefix every group can serve (never the request's last token); for a hybrid stack,
        the longest of those with a state snapshot at its end."""
        hit = self._kv_hit(request)
        if self.state_slots is None:
            return hit
        if self.snapshots is None or not len(hit):
            return PrefixHit()
        hashes = self.pools[0].block_hashes(request)
        for k in range(len(hit), 0, -1):
            if self.snapshots.lookup(hashes[k - 1]) is not None:
                return PrefixHit([t[:k] for t in hit.tables], hashes[k - 1])
        return PrefixHit()

    def _kv_hit(self, request: Request) -> PrefixHit:
        """The longest prefix every group's KV can serve."""
        full = [p for p in self.pools if not isinstance(p, SlidingWindowBlockManager)]
        sliding = [p for p in self.pools if isinstance(p, SlidingWindowBlockManager)]
        if not sliding:  # one code path for the plain models: the pool's own lookup
            return PrefixHit([p.find_cached_prefix(request) for p in self.pools])
        full_hits = {id(pool): pool.find_cached_prefix(request) for pool in full}
        k = min([(request.num_tokens - 1) // self.block_size] + [len(h) for h in full_hits.values()])
        while True:
            agreed = min([k] + [pool.longest_hit(request, k) for pool in sliding])
            if agreed == k:
                break
            k = agreed
        return PrefixHit([full_hits[id(p)][:k] if id(p) in full_hits else p.hit_blocks(request, k)
                          for p in self.pools])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (KV blocks and state snapshots); False, changing nothing, while a
        request holds blocks or a snapshot or restore is in progress."""
        pending = self.snapshots is not None and self.snapshots.num_pending > 0
        if pending or self._restores or any(pool.req_blocks for pool in self.pools):
            return False
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int, adapter: str = "") -> None:
        """Count one admission's prefix lookup in the stats (hits also per LoRA adapter, "" the base)."""
        self.prefix_queried_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens
        by_adapter = self.prefix_hit_tokens_by_adapter
        by_adapter[adapter] = by_adapter.get(adapter, 0) + hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room in every group for num_new_tokens after the request's computed tokens (plus `hit`,
        a fresh prefix hit). Returns False, taking no block, when some group cannot supply them or the
        request needs a state slot and none is free."""
        slots = self.state_slots
        if slots is not None and not slots.can_take(request):
            return False
        tables = hit.tables if hit is not None and len(hit) else [None] * len(self.pools)
        start = request.num_computed_tokens + (len(hit) if hit is not None else 0) * self.block_size
        for pool in self.pools:
            if isinstance(pool, SlidingWindowBlockManager):
                pool.remove_skipped(request, start)
        if any(pool.blocks_short(request, num_new_tokens, t) > 0
               for pool, t in zip(self.pools, tables, strict=True)):
            return False
        for pool, t in zip(self.pools, tables, strict=True):
            pool.take_slots(request, num_new_tokens, t)
        if slots is not None:
            slot = slots.take(request)
            if hit is not None and len(hit) and hit.snapshot is not None:
                self._restores.append((self.snapshots.use(hit.snapshot), slot))
        return True

    # -- state snapshots (hybrid stacks) -----------------------------------------------------------
    def snapshot_points(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Where a chunk [start, end) of the request's prompt snapshots its state: (tokens into the
        chunk, snapshot slot) per new snapshot position in (start, end], the slots reserved (pending)."""
        if self.snapshots is None or start >= request.num_prompt_tokens:
            return []
        spans = [(img.offset, img.end) for img in request.images]
        points = [p for p in self.snapshots.positions(request.num_prompt_tokens, spans, self.block_size)
                  if start < p <= end]
        if not points:
            return []
        hashes = self.pools[0].block_hashes(request)
        out = []
        for p in points:  # most useful first: a short pool keeps those
            slot = self.snapshots.reserve(hashes[p // self.block_size - 1])
            if slot is not None:
                out.append((p - start, slot))
        return sorted(out)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (source slot, destination slot) copies to run before the next step: the snapshots the
        requests admitted since the last call resume from, the parents' states of forked samples."""
        copies, self._restores = self._restores, []
        return copies

    def step_launched(self, ok: bool) -> None:
        """The step built after the last snapshot_points calls was launched (its snapshots are written
        before any later step runs) or failed (they are not)."""
        if self.snapshots is not None:
            if ok:
                self.snapshots.promote()
            else:
                self.snapshots.drop_pending()

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int, int]] | None:
        """Share the parent's KV with the child in every group (BlockManager.fork): the block copies
        the runner makes first, as (group, source, destination); None, taking nothing, when some group
        lacks a free block for its copy. A hybrid stack's child also takes a state slot (None when none is
        free) and a copy of the parent's state, made before the next step (take_state_copies) while the
        parent's slot still holds the state after the tokens they share."""
        slots = self.state_slots
        if slots is not None and not slots.can_take(child):
            return None
        if any(pool.fork_needs(parent) > pool.num_free_blocks for pool in self.pools):
            return None
        copies = []
        for group, pool in enumerate(self.pools):
            copy = pool.fork(parent, child)
            if copy is not None:
                copies.append((group, *copy))
        if slots is not None:
            self._restores.append((slots.slot(parent), slots.take(child)))
        return copies

    def free(self, request: Request) -> None:
        """Drop the request's blocks in every group (cached ones stay reusable until evicted) and its
        state slot."""
        for pool in self.pools:
            pool.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)

    def state_slot(self, request: Request) -> int:
        """The request's state slot; -1 for a model without linear layers."""
        return -1 if self.state_slots is None else self.state_slots.slot(request)

    # -- tables and stats ------------------------------------------------------------------------
    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's physical block ids per group (a sliding group's freed entries: null block 0)."""
        return [pool.block_table(request) for pool in self.pools]

    def block_table(self, request: Request) -> list[int]:
        """Group 0's table (the full layers')."""
        return self.pools[0].block_table(request)

    def num_held_blocks(self, request: Request) -> list[int]:
        """Blocks the request holds in each group (null entries excluded)."""
        return [pool.num_held(request) if isinstance(pool, SlidingWindowBlockManager)
                else len(pool.req_blocks.get(request.request_id, [])) for pool in self.pools]

    @property
    def blocks(self) -> list[KVBlock]:
        """Every pool's blocks (null blocks excluded)."""
        return [b for pool in self.pools for b in pool.blocks]

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request, in all groups."""
        return sum(pool.num_free_blocks for pool in self.pools)

    def group_stats(self) -> list[BlockStats]:
        """Each group's pool counters (the prefix counters are the manager's)."""
        return [pool.stats() for pool in self.pools]

    def group_rows(self) -> list[KvGroupStats]:
        """Each group's pool counters with its name and window, the full layers' group first."""
        rows = []
        for pool, s in zip(self.pools, self.group_stats(), strict=True):
            window = pool.window if isinstance(pool, SlidingWindowBlockManager) else 0
            rows.append(KvGroupStats(f"sliding_{window}" if window else "full", window, s.used_blocks,
                                     s.num_blocks, s.cached_free_blocks))
        return rows

    def stats(self) -> BlockStats:
        """Pool counters summed over the groups."""
        groups = self.group_stats()
        return BlockStats(sum(s.num_blocks for s in groups), sum(s.used_blocks for s in groups),
                          sum(s.cached_free_blocks for s in groups), self.prefix_queried_tokens,
                          self.prefix_hit_tokens)
