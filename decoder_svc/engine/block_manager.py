"""Paged KV blocks with image-aware prefix caching.

A full block's hash chains its parent's hash, its token ids and its extra keys (block_hashing.py: for
every image that overlaps the block, its content hash and the offset of the block's first image token
within it; the cache salt and the LoRA adapter enter the first block). Blocks nobody holds stay
cached in an LRU free queue until a new allocation evicts them. A hit never covers a request's last
token (its logits are needed) and the block's tokens are compared, so a hash collision cannot serve
wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoder_svc.engine.block_hashing import extend_block_hashes
from decoder_svc.engine.request import Request


@dataclass(eq=False)
class KVBlock:
    """One physical KV block; prev/next link it into the free queue while unreferenced."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the LRU end, append and remove anywhere."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def _insert(self, block: KVBlock, before: KVBlock) -> None:
        block.prev, block.next = before.prev, before
        before.prev.next = block
        before.prev = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Add as most recently used."""
        self._insert(block, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Add as the next to evict (blocks without cached content are worth nothing)."""
        self._insert(block, self._head.next)

    def remove(self, block: KVBlock) -> None:
        """Take a block out (a prefix hit revived it)."""
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        """The least recently used free block."""
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next
        self.remove(block)
        return block


@dataclass
class BlockStats:
    """Block-pool counters."""

    num_blocks: int
    used_blocks: int
    cached_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


class BlockManager:
    """Allocates KV blocks to requests and reuses cached prefixes (one KV cache group's pool)."""

    # The placeholder a sliding-window pool puts in tables for blocks it freed (sliding_block_manager.py);
    # a full pool has none.
    null_block: KVBlock | None = None

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._req_num_registered: dict[str, int] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hit_tokens_by_adapter: dict[str, int] = {}

    # -- hashing ---------------------------------------------------------------------------------
    def block_hashes(self, request: Request, num_tokens: int | None = None) -> list[bytes]:
        """Hashes of the request's full blocks among its first num_tokens tokens (memoised)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        n_full = (request.num_tokens if num_tokens is None else num_tokens) // self.block_size
        extend_block_hashes(hashes, request, n_full, self.block_size)
        return hashes[:n_full]

    # -- prefix lookup ---------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching the request's start; never its last token."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hit: list[KVBlock] = []
        for i, h in enumerate(self.block_hashes(request)[:max_blocks]):
            block = self.cached.get(h)
            expect = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            if block is None or block.token_ids != expect:
                break
            hit.append(block)
        return hit

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int, adapter: str = "") -> None:
        """Count one admission's prefix lookup in the stats (hits also per LoRA adapter, "" the base)."""
        self.prefix_queried_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens
        by_adapter = self.prefix_hit_tokens_by_adapter
        by_adapter[adapter] = by_adapter.get(adapter, 0) + hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def blocks_short(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[KVBlock] | None = None) -> int:
        """How many blocks the pool lacks for allocate_slots(request, num_new_tokens, computed_blocks)
        (<= 0: it can supply them). Changes nothing."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(held) - len(computed_blocks)
        # Hit blocks in the free queue are revived, not evictable.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0 and b is not self.null_block)
        return need - (len(self.free_queue) - revived)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens after the request's computed tokens (plus computed_blocks, a
        fresh prefix hit). Returns False, changing nothing, when the pool cannot supply the blocks."""
        if self.blocks_short(request, num_new_tokens, computed_blocks) > 0:
            return False
        self.take_slots(request, num_new_tokens, computed_blocks)
        return True

    def take_slots(self, request: Request, num_new_tokens: int,
                   computed_blocks: list[KVBlock] | None = None) -> None:
        """allocate_slots once blocks_short said the pool can supply the blocks."""
        computed_blocks = computed_blocks or []
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        blocks = self.req_blocks.setdefault(request.request_id, [])
        need = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        for b in computed_blocks:
            if b is not self.null_block:
                if b.ref_cnt == 0:
                    self.free_queue.remove(b)
                b.ref_cnt += 1
            blocks.append(b)
        for _ in range(max(need, 0)):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            blocks.append(b)
        # A token a launched step samples (asynchronous scheduling) is not known yet: its block is
        # registered by a later allocation.
        self._register_full_blocks(request, min(total, request.num_tokens))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        # The tokens of every block that this step fills are known now, and its KV is written by this
        # step's forward before any later step can look it up.
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks[rid]
        hashes = self.block_hashes(request, num_tokens)
        start = self._req_num_registered.get(rid, 0)
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, len(hashes)):
            b = blocks[i]
            if b.block_hash is None and b is not self.null_block and hashes[i] not in self.cached:
                b.block_hash, b.token_ids = hashes[i], tuple(tokens[i * bs:(i + 1) * bs])
                self.cached[hashes[i]] = b
        self._req_num_registered[rid] = max(start, len(hashes))

    # -- forking (engine/fanout.py) -----------------------------------------------------------------
    def fork_needs(self, parent: Request) -> int:
        """Blocks fork() takes from the pool: 1 when the parent's computed tokens end inside a block
        (its copy), else 0."""
        return int(parent.num_computed_tokens % self.block_size != 0)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give the child the parent's table for its computed tokens: the full blocks shared (their
        reference counts raised, as a prefix hit does), the last, partial one a fresh block whose KV the
        runner copies from the parent's (returned as (source, destination); None: no partial block).
        The caller checked fork_needs against num_free_blocks."""
        held = self.req_blocks.get(parent.request_id, [])
        n_full = parent.num_computed_tokens // self.block_size
        table = []
        for b in held[:n_full]:
            if b is not self.null_block:
                b.ref_cnt += 1
            table.append(b)
        copy = None
        if self.fork_needs(parent):
            src = held[n_full]
            dst = self.free_queue.popleft()
            self._evict(dst)
            dst.ref_cnt = 1
            table.append(dst)
            copy = (src.block_id, dst.block_id)
        self.req_blocks[child.request_id] = table
        pid, cid = parent.request_id, child.request_id
        if pid in self._req_hashes:  # the prompt's blocks hash alike (shared between a manager's pools)
            self._req_hashes.setdefault(cid, list(self._req_hashes[pid]))
        self._req_num_registered[cid] = min(self._req_num_registered.get(pid, 0), n_full)
        return copy

    def free(self, request: Request) -> None:
        """Drop the request's references; its cached blocks stay reusable until evicted."""
        rid = request.request_id
        # Tail blocks first, so a prefix's later blocks are evicted before its earlier ones.
        for b in reversed(self.req_blocks.pop(rid, [])):
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (self.free_queue.append if b.block_hash is not None else self.free_queue.appendleft)(b)
        self._req_num_registered.pop(rid, None)
        self._req_hashes.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, leaving the pool as at its start; False (nothing changed) while a
        request holds blocks."""
        if self.req_blocks:
            return False
        for b in self.blocks:
            b.block_hash, b.token_ids = None, ()
        self.cached.clear()
        self.free_queue = FreeBlockQueue(self.blocks)
        return True

    def block_table(self, request: Request) -> list[int]:
        """Physical block ids of the request, in order."""
        return [b.block_id for b in self.req_blocks.get(request.request_id, [])]

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached or empty)."""
        return len(self.free_queue)

    def stats(self) -> BlockStats:
        """Current pool counters."""
        cached_free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        return BlockStats(len(self.blocks), len(self.blocks) - len(self.free_queue), cached_free,
                          self.prefix_queried_tokens, self.prefix_hit_tokens)
