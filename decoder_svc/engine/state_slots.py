"""State slots of a hybrid stack's linear-attention layers (model/linear_state.py holds the tensors): one
per running request, taken when it is admitted (its first allocation) and given back when it ends or is
preempted. A request holds its slot across all its chunks, so the state carries from chunk to chunk; a
preempted one recomputes from position 0 in whatever slot it gets next."""

from __future__ import annotations

from decoder_svc.engine.request import Request


class StateSlots:
    """Hands out slot numbers 0..num_slots-1, one per request id."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a hybrid model needs at least one state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owned: dict[str, int] = {}

    def holds(self, request: Request) -> bool:
        """True when the request has a slot."""
        return request.request_id in self._owned

    def can_take(self, request: Request) -> bool:
        """True when the request has a slot or one is free."""
        return self.holds(request) or bool(self._free)

    def take(self, request: Request) -> int:
        """The request's slot, taking a free one if it has none (check can_take first)."""
        slot = self._owned.get(request.request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError("no free state slot")
            slot = self._owned[request.request_id] = self._free.pop()
        return slot

    def slot(self, request: Request) -> int:
        """The request's slot; KeyError when it holds none."""
        return self._owned[request.request_id]

    def free(self, request: Request) -> None:
        """Give the request's slot back (nothing when it holds none)."""
        slot = self._owned.pop(request.request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_used(self) -> int:
        """Slots held by requests."""
        return len(self._owned)
