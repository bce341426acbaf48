"""A JSON line per engine step, for profiling the core's loop under load (`mmserve decoder --step-trace
FILE`): when the step began and how long it took, what it computed, what was queued, and what the loop
did before it (commands handled, time waiting for work). `bench/step_trace.py` summarises a file.

Fields: `t` (monotonic start, seconds), `s` (step seconds), `tokens`, `prefill` / `decode` (chunks of
more than one token / of one), `sampled` (first tokens among the outputs), `running`, `waiting`,
`commands` (handled since the previous step), `idle` (seconds the loop waited for a command or an
embedding since the previous step), `received` (when the front end got each request whose first token
this step sampled: a client on the same host finds its request's crossing of gRPC from it).

For a burst's per-request timeline (`bench/burst_timeline.py`): `prefilled` lists the step's prompt
chunks as [request id, start, tokens], and `firsts` each first token's request as [request id,
received, added, images_ready] (RequestTimes' stamps: the front end got it, the engine queued it, its
last awaited embedding arrived; 0 where not reached). With asynchronous scheduling a step's outputs are
the step launched before it: a first token is in the record after its last chunk's.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import IO


@dataclass
class StepRecord:
    """One step of the engine core's loop."""

    t: float
    s: float
    tokens: int
    prefill: int
    decode: int
    sampled: int
    running: int
    waiting: int
    commands: int
    idle: float
    received: list[float] = field(default_factory=list)
    prefilled: list[list] = field(default_factory=list)  # [request id, start, tokens] per prompt chunk
    firsts: list[list] = field(default_factory=list)  # [request id, received, added, images_ready]


class StepTrace:
    """Appends StepRecords to a file, line-buffered (a killed core loses at most the line being written)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - open for the core's life

    def write(self, record: StepRecord) -> None:
        """Append one step's line."""
        self._file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def now() -> float:
    """The trace's clock (monotonic, the TTFT stamps' clock)."""
    return time.monotonic()
