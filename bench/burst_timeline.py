"""Where a burst's time went, per request, from the decoder's step trace (`mmserve decoder --step-trace
FILE`, decoder_svc/step_trace.py): a table and a picture.

    python -m bench.burst_timeline FILE [--since T] [--until T] [--png burst.png] [--json rows.json]

Per request (the ones whose first token is in the window): when the front end got it (`received`), when
the engine queued it (`added`), when its last awaited embedding arrived (`images_ready`, 0: none
awaited), each prompt chunk's step (start, end, tokens) and the end of the step that returned its first
token. Times are milliseconds from the earliest arrival. The picture draws a row per request in arrival
order: a thin line from arrival to its embeddings, a bar per prefill chunk's step, a dot at the first
token.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.report import print_table
from bench.step_trace import read_trace


@dataclass
class ChunkSpan:
    """One prompt chunk: its step's start and end (ms) and its tokens."""

    start_ms: float
    end_ms: float
    tokens: int


@dataclass
class RequestTimeline:
    """One request of the burst; times in ms from the window's origin (the earliest arrival)."""

    request_id: str
    arrival_ms: float  # the front end got it (the engine's queueing when the front end's stamp is 0)
    added_ms: float
    images_ready_ms: float | None  # None: no embedding awaited
    chunks: list[ChunkSpan] = field(default_factory=list)
    first_token_ms: float = 0.0

    @property
    def ttft_ms(self) -> float:
        """Arrival to the first token's step end."""
        return self.first_token_ms - self.arrival_ms

    @property
    def prefill_start_ms(self) -> float | None:
        """Its first prompt chunk's step start (None: no chunk in the window, e.g. all cached)."""
        return self.chunks[0].start_ms if self.chunks else None


def build_timelines(records: Sequence[dict]) -> list[RequestTimeline]:
    """Per request with a first token in `records`, in arrival order (records: read_trace's)."""
    chunks: dict[str, list[tuple[float, float, int]]] = {}
    firsts: dict[str, tuple[list, float]] = {}
    for rec in records:
        end = rec["t"] + rec["s"]
        for rid, _start, tokens in rec.get("prefilled", []):
            chunks.setdefault(rid, []).append((rec["t"], end, tokens))
        for first in rec.get("firsts", []):
            firsts.setdefault(first[0], (first, end))
    if not firsts:
        return []

    def arrival(first: list) -> float:
        _, received, added, _ = first
        return received or added

    origin = min(arrival(f) for f, _ in firsts.values())

    def ms(t: float) -> float:
        return round((t - origin) * 1000, 3)

    rows = []
    for rid, (first, end) in firsts.items():
        _, _, added, ready = first
        # prompt chunks after the first token are a preempted request's recompute: not the burst's
        spans = [ChunkSpan(ms(a), ms(b), n) for a, b, n in chunks.get(rid, []) if a < end]
        rows.append(RequestTimeline(rid, ms(arrival(first)), ms(added), ms(ready) if ready else None, spans,
                                    ms(end)))
    rows.sort(key=lambda r: (r.arrival_ms, r.request_id))
    return rows


def table_rows(rows: Sequence[RequestTimeline]) -> list[list]:
    """The printed table's rows: id, arrival, embeddings ready, prefill start, chunks, first token, TTFT."""
    return [[r.request_id, r.arrival_ms, r.images_ready_ms, r.prefill_start_ms, len(r.chunks),
             r.first_token_ms, r.ttft_ms] for r in rows]


COLUMNS = ["request", "arrival ms", "embeddings ms", "prefill start ms", "chunks", "first token ms",
           "TTFT ms"]


def plot(rows: Sequence[RequestTimeline], path: str | Path, title: str = "burst timeline") -> Path:
    """A PNG of the timeline: a row per request, top to bottom in arrival order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.28 * len(rows) + 1.2)))
    for y, r in enumerate(rows):
        waited_to = r.images_ready_ms if r.images_ready_ms is not None else r.added_ms
        ax.plot([r.arrival_ms, waited_to], [y, y], color="0.6", lw=1.5,
                label="arrival to embeddings" if y == 0 else None)
        bars = [(c.start_ms, max(c.end_ms - c.start_ms, 1e-3)) for c in r.chunks]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors="tab:blue", edgecolors="white",
                       label="prefill chunk's step" if y == 0 else None)
        ax.plot([r.first_token_ms], [y], "o", color="tab:red", ms=4, label="first token" if y == 0 else None)
    ax.set_yticks(range(len(rows)), [r.request_id for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first arrival")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-request table of a trace; --png draws it, --json writes the rows."""
    p = argparse.ArgumentParser(prog="python -m bench.burst_timeline", description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--since", type=float, default=float("-inf"), help="monotonic seconds")
    p.add_argument("--until", type=float, default=float("inf"), help="monotonic seconds")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--title", default="burst timeline")
    args = p.parse_args(argv)
    rows = build_timelines(read_trace(args.trace, args.since, args.until))
    print_table(args.title, COLUMNS, table_rows(rows))
    if args.png:
        plot(rows, args.png, args.title)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
