"""What `n` costs in memory: the RSS growth of the gateway and the decoder while they answer one chat
request with a large data-URL image for n=1, for n=N in one request (GenerateRequest.n: the image sent,
decoded and prefilled once), and for N separate n=1 requests sent at once (what `n` cost when the gateway
sent one decoder request per choice).

    python -m bench.n_choices_rss --preset tiny --n 32 --image-side 1530 --out n_rss.json

Each case runs on services of its own (an encoder, a decoder and a gateway, started fresh), so one case's
allocations cannot hide another's. Growth is each process's peak RSS (VmHWM, reset through clear_refs
before the request; sampled every 10 ms where the kernel refuses the reset) minus its RSS before the
request, summed over the service's processes (the decoder's front end and its engine core).
"""

from __future__ import annotations

import argparse
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.gateway_latency import GatewayProcess
from bench.models import add_model_args, resolve_model
from bench.report import print_table, save_result
from bench.services import Pair, exit_on_sigterm
from bench.workload import random_png

CASES = ("n1", "n", "separate")


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the n-choices memory benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.n_choices_rss", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--n", type=int, default=32, help="choices of the large request")
    p.add_argument("--image-side", type=int, default=1530,
                   help="side of the square noise PNG (1530: about 7 MB)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES), help=f"which of {', '.join(CASES)}")
    p.add_argument("--decoder-args", default="--num-kv-blocks 1024",
                   help="extra decoder flags (each case's decoder is spawned with them)")
    p.add_argument("--logs", default=None, help="directory for the services' logs")
    p.add_argument("--out", default=None)
    return p


# -- process memory (Linux /proc) ----------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """pid and every descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (clear_refs 5); False where the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakWatch:
    """Each process's peak RSS over a span, in bytes: VmHWM after a reset where the kernel allows it,
    else the largest RSS sampled every 10 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.before = {p: _status_kb(p, "VmRSS") * 1024 for p in pids}
        self.hwm = {p: reset_peak(p) for p in pids}
        self.sampled = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            for p in self.pids:
                self.sampled[p] = max(self.sampled[p], _status_kb(p, "VmRSS") * 1024)

    def growth(self) -> int:
        """Bytes of peak RSS above the start, summed over the processes."""
        self._stop.set()
        self._thread.join()
        total = 0
        for p in self.pids:
            peak = _status_kb(p, "VmHWM") * 1024 if self.hwm[p] else self.sampled[p]
            total += max(peak, self.sampled[p]) - self.before[p]
        return total


# -- the requests ----------------------------------------------------------------------------------
def chat_body(model: str, url: str, n: int, max_tokens: int) -> dict:
    """A chat request for n choices over the image's data URL."""
    return {"model": model, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"}]}]}


def post(http: httpx.Client, body: dict) -> int:
    """Send one request; the number of choices answered."""
    reply = http.post("/v1/chat/completions", json=body)
    if reply.status_code != 200:
        raise RuntimeError(f"gateway: HTTP {reply.status_code}: {reply.text[:500]}")
    return len(reply.json()["choices"])


def run_case(case: str, args: argparse.Namespace, model: Path, url: str, logs: Path) -> dict:
    """Fresh services; a small warm-up request; then the case's requests with the processes watched."""
    pair = Pair(model, args.device, args.dtype, [], args.decoder_args.split(), logs / case).start()
    gateway = None
    try:
        gateway = GatewayProcess(pair.decoder.address, model, logs / case)
        with httpx.Client(base_url=gateway.url, timeout=600) as http:
            small = "data:image/png;base64," + base64.b64encode(random_png(99, 64)).decode()
            post(http, chat_body("bench", small, 2, args.max_tokens))  # imports, buffers, first steps
            time.sleep(0.5)
            watches = {"gateway": PeakWatch(process_tree(gateway.proc.pid)),
                       "decoder": PeakWatch(process_tree(pair.decoder.proc.pid))}
            started = time.perf_counter()
            if case == "separate":
                with ThreadPoolExecutor(args.n) as pool:
                    answered = sum(pool.map(lambda _: post(http, chat_body("bench", url, 1, args.max_tokens)),
                                            range(args.n)))
            else:
                answered = post(http, chat_body("bench", url, 1 if case == "n1" else args.n, args.max_tokens))
            seconds = time.perf_counter() - started
            growth = {name: watch.growth() for name, watch in watches.items()}
    finally:
        if gateway is not None:
            gateway.stop()
        pair.stop()
    return {"case": case, "choices": answered, "seconds": seconds,
            "gateway_growth_mb": growth["gateway"] / 2**20, "decoder_growth_mb": growth["decoder"] / 2**20}


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the JSON payload."""
    exit_on_sigterm()
    model = resolve_model(args)
    png = random_png(7, args.image_side)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    logs = Path(args.logs) if args.logs else Path(f"/tmp/mmserve-n-rss-{int(time.time())}")
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
        rows.append(run_case(case, args, model, url, logs))
    by_case = {r["case"]: r for r in rows}
    ratios = {}
    if "n1" in by_case:
        base = by_case["n1"]
        for r in rows:
            for side in ("gateway", "decoder"):
                key = f"{side}_growth_mb"
                r[f"{side}_x_n1"] = r[key] / base[key] if base[key] > 0 else None
        if "n" in by_case:
            ratios = {side: by_case["n"][f"{side}_x_n1"] for side in ("gateway", "decoder")}
    print_table(f"RSS growth, one {len(png) / 1e6:.1f} MB image, n={args.n}",
                ["case", "choices", "s", "gateway MB", "x n1", "decoder MB", "x n1"],
                [[r["case"], r["choices"], r["seconds"], r["gateway_growth_mb"], r.get("gateway_x_n1"),
                  r["decoder_growth_mb"], r.get("decoder_x_n1")] for r in rows])
    return save_result("n_choices_rss", args, {"cases": rows, "n_over_n1": ratios},
                       image_bytes=len(png))


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    run(build_arg_parser().parse_args(argv))  # writes --out itself
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
