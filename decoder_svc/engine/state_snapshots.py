"""Prefix reuse over a hybrid stack's linear-attention state: snapshots of every linear layer's state
after a prompt prefix, kept beside the KV blocks of that prefix.

A linear layer has no per-token KV: its state after a prefix is one snapshot, so a prefix hit needs the KV
blocks of the attention layers and a snapshot of the linear layers' state taken at the hit's end. A
snapshot is keyed exactly like the KV block it ends with: that block's hash, which chains the tokens, the
images' content hashes, the cache salt and the LoRA adapter of everything before it
(engine/block_hashing.py).

Where: at block-aligned prompt positions p (0 < p < the prompt's length): every `interval` blocks except
inside an image, the last block boundary at or before the end of each image or video span (a new
question about the same image shares the prefix up to there), and the last block boundary of the prompt
(the same prompt again, a conversation's next turn); when slots run short the last two kinds are
reserved first. Image ends and interval points go down to a multiple of STATE_CHUNK tokens where one lies
past 0: a prefill from the prompt's start (or from another such snapshot) reads the state there from the
chunked rule's own chunk states, where another position would cut the prefill into one more chunked call
per layer (model/gated_deltanet_fla.py); the prompt's last boundary stays, as the piece after it is under a
block, which one launch of the token-by-token kernel runs. The linear layers write the state at those
positions into a snapshot slot of the state pool (model/linear_state.py), in the same forward.

Slots: the pool's slots after the requests' own (`first_slot` on). A snapshot is `pending` from the
step whose forward writes it until the next step is built (`promote`): only then can a request resume
from it (its restore copy runs before that next step's forward, after the write). Indexed snapshots are
evicted least recently used when a new one needs a slot; pending ones never are.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from math import lcm

from decoder_svc.model.gated_deltanet_fla import FLA_CHUNK as STATE_CHUNK  # snapshots at multiples of it


@dataclass
class SnapshotCounters:
    """Monotonic counters for stats."""

    hits: int = 0        # admissions that resumed from a snapshot
    taken: int = 0       # snapshots written
    evictions: int = 0   # snapshots dropped for newer ones


class StateSnapshots:
    """The index of state snapshots (block hash -> pool slot), LRU over `num_slots` slots."""

    def __init__(self, num_slots: int, first_slot: int, interval_blocks: int,
                 bytes_per_snapshot: int) -> None:
        if interval_blocks < 1:
            raise ValueError("the snapshot interval is at least one block")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self.interval_blocks = interval_blocks
        self.bytes_per_snapshot = bytes_per_snapshot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, int] = {}
        self.counters = SnapshotCounters()

    def lookup(self, key: bytes) -> int | None:
        """The slot of the indexed snapshot under key, or None (pending ones are not visible yet)."""
        return self._index.get(key)

    def use(self, key: bytes) -> int:
        """The slot of an indexed snapshot a request resumes from (counted as a hit, made most recent)."""
        self._index.move_to_end(key)
        self.counters.hits += 1
        return self._index[key]

    def reserve(self, key: bytes) -> int | None:
        """A slot for a new snapshot under key (pending until `promote`), evicting the least recently used
        indexed one when none is free; None when key is held already or every slot is pending."""
        if key in self._index or key in self._pending:
            return None
        if not self._free:
            if not self._index:
                return None
            _, slot = self._index.popitem(last=False)
            self._free.append(slot)
            self.counters.evictions += 1
        slot = self._pending[key] = self._free.pop()
        return slot

    def promote(self) -> None:
        """The pending snapshots were written (their step's forward ran before anything built after this
        call): make them visible."""
        for key, slot in self._pending.items():
            self._index[key] = slot
        self.counters.taken += len(self._pending)
        self._pending.clear()

    def drop_pending(self) -> None:
        """Forget the pending snapshots (their step failed: what they hold is not known)."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def clear(self) -> bool:
        """Forget every snapshot, the slots free as at the start; False (nothing changed) while one is
        pending (its step has not been built on yet)."""
        if self._pending:
            return False
        self._index.clear()
        self._free = list(range(self.first_slot + self.num_slots - 1, self.first_slot - 1, -1))
        return True

    @property
    def num_held(self) -> int:
        """Indexed snapshots."""
        return len(self._index)

    @property
    def num_pending(self) -> int:
        """Snapshots reserved and not yet visible."""
        return len(self._pending)

    @property
    def bytes_held(self) -> int:
        """Bytes of the indexed snapshots."""
        return self.num_held * self.bytes_per_snapshot

    def positions(self, prompt_tokens: int, spans: list[tuple[int, int]], block_size: int) -> list[int]:
        """The prompt positions where a request's state is snapshotted: block-aligned, in (0, prompt_tokens
        - 1] (a prefix hit never covers the prompt's last token); spans: (offset, end) of its images.
        Most useful first, the order slots are reserved in when they run short: the prompt's last
        boundary (the same prompt again, a conversation's next turn), the images' last boundaries (a new
        question about the same image), then the interval points; each kind latest first. An interval
        point inside an image is left out: a prefix that reaches it holds the image's tokens up to there,
        so it reaches the image's own snapshot too (and each snapshot costs a slot). An image's and an
        interval point go down to a multiple of STATE_CHUNK (and of the block) where that is past 0."""
        chunk = lcm(block_size, STATE_CHUNK)

        def aligned(p: int) -> int:
            return p // chunk * chunk or p // block_size * block_size

        last = (prompt_tokens - 1) // block_size * block_size
        step = self.interval_blocks * block_size
        images = sorted({aligned(end) for _, end in spans}, reverse=True)
        intervals = [aligned(p) for p in range(last // step * step, 0, -step)
                     if not any(offset < p < end for offset, end in spans)]
        ranked = [last, *images, *intervals]
        return [p for p in dict.fromkeys(ranked) if 0 < p <= last]
