"""The block pool of a sliding-window KV cache group: a request holds only the blocks its window can
still see.

Tables stay logical: entry i stands for tokens [i * block_size, (i + 1) * block_size). An entry whose
block was freed, or never held (before a prefix hit's window), is the null block: physical block 0 of
the group's tensors, outside the pool, never written (slot mappings never name it: a sequence's new
tokens lie in its live blocks, padded rows have slot -1), so it holds the zeros it was allocated with.
Attention masks every key it stands for, but a kernel may still read it (a key tile straddling the
window's start): finite values keep the masked products finite.

Freeing. A query at position p sees keys > p - window. When a request's next chunk starts at c (its
computed tokens), no query of it will ever see a key <= c - window again, so a block whose last token
is <= c - window is dropped: `remove_skipped` before each allocation (its ref count goes down; at zero
it returns to the free queue, reusable by a prefix hit while cached, else evicted first).

Asynchronous scheduling. The scheduler advances num_computed_tokens when it schedules a chunk, so the
step launched before (still running) may read blocks that this allocation frees, for its own earlier
queries. They can be handed out again at once: only steps launched after this one's allocation write
into them, and every step runs on the same stream (each tensor-parallel rank's steps on its own one),
after the step that reads them. The freeing step itself never reads a block it freed: its tables hold
the null block there.
"""

from __future__ import annotations

from decoder_svc.engine.block_manager import BlockManager, KVBlock
from decoder_svc.engine.request import Request


def first_visible_block(start: int, window: int, block_size: int) -> int:
    """The first block a query at position `start` (or later) can see: the one holding start - window + 1."""
    return max(start - window + 1, 0) // block_size


class SlidingWindowBlockManager(BlockManager):
    """A BlockManager whose requests drop the blocks that fell out of their window; ids 1..num_blocks
    (0 is the null block)."""

    def __init__(self, num_blocks: int, window: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        if window < 1:
            raise ValueError("a sliding window must hold at least one key")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        for b in self.blocks:
            b.block_id += 1
        self.null_block = KVBlock(0)
        self.window = window
        self._req_num_skipped: dict[str, int] = {}  # leading table entries already null

    def remove_skipped(self, request: Request, start: int) -> None:
        """Drop the blocks no query at `start` or later can see (see the module's docstring)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        end = min(first_visible_block(start, self.window, self.block_size), len(blocks))
        done = self._req_num_skipped.get(rid, 0)
        # Later blocks first, as free() does: the earliest of a prefix is evicted last.
        for i in range(end - 1, done - 1, -1):
            b = blocks[i]
            if b is self.null_block:
                continue
            blocks[i] = self.null_block
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (self.free_queue.append if b.block_hash is not None else self.free_queue.appendleft)(b)
        self._req_num_skipped[rid] = max(done, end)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """BlockManager.fork; the child's table has the parent's null entries (blocks out of its window)."""
        copy = super().fork(parent, child)
        skipped = self._req_num_skipped.get(parent.request_id)
        if skipped is not None:
            self._req_num_skipped[child.request_id] = skipped
        return copy

    def free(self, request: Request) -> None:
        """Drop the request's references (see BlockManager.free)."""
        super().free(request)
        self._req_num_skipped.pop(request.request_id, None)

    def num_held(self, request: Request) -> int:
        """Blocks the request holds (null entries excluded)."""
        return sum(b is not self.null_block for b in self.req_blocks.get(request.request_id, []))

    def _cached(self, hashes: list[bytes], tokens: list[int], i: int) -> KVBlock | None:
        block = self.cached.get(hashes[i])
        bs = self.block_size
        if block is None or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
            return None
        return block

    def longest_hit(self, request: Request, max_blocks: int) -> int:
        """The largest k <= max_blocks such that a query at k * block_size finds every block it can see
        cached (blocks first_visible_block(k * bs) .. k - 1): scanned from the right, O(max_blocks)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return 0
        hashes = self.block_hashes(request, max_blocks * self.block_size)
        tokens = request.all_token_ids
        k = max_blocks
        i = k - 1
        while k > 0:
            if i < first_visible_block(k * self.block_size, self.window, self.block_size):
                return k  # every block k's queries see is cached
            if self._cached(hashes, tokens, i) is None:
                k = i  # no hit can end above a missing block and see it
            i -= 1
        return 0

    def hit_blocks(self, request: Request, num_blocks: int) -> list[KVBlock]:
        """The table of a hit of num_blocks blocks (longest_hit said it is cached): null up to the
        window's first block, then the cached ones."""
        hashes = self.block_hashes(request, num_blocks * self.block_size)
        first = first_visible_block(num_blocks * self.block_size, self.window, self.block_size)
        tokens = request.all_token_ids
        out = [self.null_block] * min(first, num_blocks)
        for i in range(len(out), num_blocks):
            block = self._cached(hashes, tokens, i)
            assert block is not None, "hit_blocks after a longest_hit that found them"
            out.append(block)
        return out

    def take_slots(self, request: Request, num_new_tokens: int,
                   computed_blocks: list[KVBlock] | None = None) -> None:
        """BlockManager.take_slots; a hit's leading null entries count as skipped."""
        if computed_blocks:
            self._req_num_skipped[request.request_id] = sum(b is self.null_block for b in computed_blocks)
        super().take_slots(request, num_new_tokens, computed_blocks)
