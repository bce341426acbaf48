"""What the decoder's engine core did over a window: a summary of its step trace (`mmserve decoder
--step-trace FILE`, decoder_svc/step_trace.py).

    python -m bench.step_trace FILE [--since T] [--until T]

Busy is the steps' share of the window; idle the loop's waits for a command or an embedding; `gaps`
the rest (command handling, output sending, the loop itself). Steps are split by what they computed:
prefill (any chunk longer than a token), decode only, and empty (every request waited).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_trace(path: str | Path, since: float = float("-inf"), until: float = float("inf")) -> list[dict]:
    """The records of steps that began in [since, until]."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed core
            continue
        if since <= rec["t"] <= until:
            out.append(rec)
    return out


def summarize(records: list[dict], since: float | None = None, until: float | None = None) -> dict:
    """Step counts, times (ms) and tokens over the window [since, until] (default: the records' span)."""
    if not records:
        return {"steps": 0}
    since = records[0]["t"] if since is None else since
    until = records[-1]["t"] + records[-1]["s"] if until is None else until
    window = max(until - since, 1e-9)
    kinds = {"prefill": [r for r in records if r["prefill"]],
             "decode": [r for r in records if not r["prefill"] and r["decode"]],
             "empty": [r for r in records if not r["tokens"]]}
    busy = sum(r["s"] for r in records)
    # The first step's wait began before the window, perhaps long before.
    idle = sum(r["idle"] for r in records[1:]) + min(records[0]["idle"], max(records[0]["t"] - since, 0.0))

    def ms(x: float) -> float:
        return round(x * 1000, 2)

    out = {"steps": len(records), "window_ms": ms(window), "busy": round(busy / window, 3),
           "idle_ms": ms(idle), "gaps_ms": ms(max(window - busy - idle, 0.0)),
           "first_step_after_ms": ms(records[0]["t"] - since),
           "commands": sum(r["commands"] for r in records),
           "first_tokens": sum(r["sampled"] for r in records)}
    for name, recs in kinds.items():
        if not recs:
            continue
        out[name] = {"steps": len(recs), "ms": ms(sum(r["s"] for r in recs)),
                     "ms_p50": ms(statistics.median(r["s"] for r in recs)),
                     "ms_max": ms(max(r["s"] for r in recs)),
                     "tokens_mean": round(statistics.mean(r["tokens"] for r in recs), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the summary of a trace file (optionally of a window of it) as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.step_trace", description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--since", type=float, default=float("-inf"), help="monotonic seconds")
    p.add_argument("--until", type=float, default=float("inf"), help="monotonic seconds")
    args = p.parse_args(argv)
    print(json.dumps(summarize(read_trace(args.trace, args.since, args.until)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
