"""Where the memory goes after a flood of large data-URL images (RELIABILITY.md, "Faults under load").

    python -m bench.experiments.flood_rss [--model DIR] [--requests 24] [--concurrency 3]

An encoder, a decoder and the gateway as processes on the tiny model (CPU); a warm-up of small image
requests, then `--requests` chat requests each carrying a distinct noise PNG as a data URL (1344x1344:
about 5.4 MB, 7.2 MB as base64, as bench/chaos.py's cache_flood), `--concurrency` at a time. Prints each
service's RSS (children included) after the warm-up, `--idle-seconds` after the flood, and again after
glibc's malloc_trim(0) was called in each of its processes through gdb: what the trim returns is free
memory glibc kept in its arenas; what stays over the warm-up level is live objects (or fragmentation a
trim cannot return).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.chaos import GatewayService
from bench.services import decoder_service, encoder_service, exit_on_sigterm
from bench.soak import noise_image, process_tree, rss_mib


def tree_rss(pid: int) -> float:
    """MiB resident in pid and its descendants."""
    return round(sum(rss_mib(p)["rss"] for p in process_tree(pid)), 1)


def by_process(pid: int) -> dict[str, float]:
    """MiB resident per process of the tree, named by pid and the process's own name."""
    out = {}
    for p in process_tree(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        out[f"{p} {name}"] = round(rss_mib(p)["rss"], 1)
    return out


def trim_in(pid: int, collect_to: Path | None = None) -> bool:
    """Call malloc_trim(0) inside a running process (gdb attaches for a moment), after a full garbage
    collection whose count of unreachable objects is written to `collect_to` when given; False when it
    cannot."""
    calls = ["call (int) malloc_trim(0)"]
    if collect_to is not None:
        code = f"import gc; open('{collect_to}', 'w').write(str(gc.collect()))"
        calls = ["call (int) PyGILState_Ensure()", f'call (int) PyRun_SimpleString("{code}")',
                 "call (void) PyGILState_Release($1)", *calls]
    argv = ["gdb", "-p", str(pid), "-batch", "-nx"]
    for c in calls:
        argv += ["-ex", c]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return done.returncode == 0 and f"${len(calls) - (collect_to is not None)} = " in done.stdout


def body(png: bytes, model: str, max_tokens: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "describe"}]}]}


errors: list[str] = []  # the first bodies of answers other than 200


async def send_all(url: str, images: list[bytes], concurrency: int, max_tokens: int) -> list[int]:
    """POST one request per image, `concurrency` at a time; the HTTP statuses."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url.replace("/chat/completions", "/models"))).json()["data"][0]["id"]

        async def one(png: bytes) -> int:
            async with sem:
                answer = await client.post(url, json=body(png, model, max_tokens))
                if answer.status_code != 200:
                    errors.append(f"{answer.status_code} {answer.text[:200]}")
                return answer.status_code
        return list(await asyncio.gather(*(one(p) for p in images)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/mmserve-bench-qwen2.5-vl-tiny")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--side", type=int, default=1344)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--no-gdb", action="store_true", help="skip the trim through gdb")
    args = p.parse_args()
    model = Path(args.model)
    if not (model / "mmserve_model.json").exists():
        from common.model_maker import make_model

        make_model("qwen2.5-vl-tiny", model, seed=0, device="cpu", progress=False)
    logs = Path(tempfile.mkdtemp(prefix="flood-rss-"))
    exit_on_sigterm()
    encoder = encoder_service(model, logs, extra=["--cache-bytes", str(64 << 20)])
    encoder.start()
    decoder = decoder_service(model, encoder.address, logs)
    gateway = None
    try:
        decoder.start()
        gateway = GatewayService("gateway", ["gateway", "--decoder", decoder.address, "--model", str(model)],
                                 logs / "gateway.log")
        gateway.launch().wait()
        services = {"gateway": gateway, "decoder": decoder, "encoder": encoder}
        url = f"http://{gateway.address}/v1/chat/completions"
        small = [noise_image(1000 + i, 224, 224) for i in range(args.warmup)]
        statuses = asyncio.run(send_all(url, small, 1, args.max_tokens))
        time.sleep(args.idle_seconds)
        warm = {n: tree_rss(s.proc.pid) for n, s in services.items()}
        warm_each = {n: by_process(s.proc.pid) for n, s in services.items()}
        flood = [noise_image(50_000 + i, args.side, args.side) for i in range(args.requests)]
        mb = len(base64.b64encode(flood[0])) / 1e6
        t0 = time.monotonic()
        statuses += asyncio.run(send_all(url, flood, args.concurrency, args.max_tokens))
        flood_s = time.monotonic() - t0
        time.sleep(args.idle_seconds)
        idle = {n: tree_rss(s.proc.pid) for n, s in services.items()}
        idle_each = {n: by_process(s.proc.pid) for n, s in services.items()}
        trimmed, trimmed_each, collected, collected_each, unreachable = {}, {}, {}, {}, {}
        if not args.no_gdb:
            for n, s in services.items():
                ok = all([trim_in(pid) for pid in process_tree(s.proc.pid)])
                trimmed[n] = tree_rss(s.proc.pid) if ok else None
                trimmed_each[n] = by_process(s.proc.pid)
            for n, s in services.items():  # then a full collection in each Python process, and a trim
                for pid in process_tree(s.proc.pid):
                    note = logs / f"gc-{pid}.txt"
                    if trim_in(pid, note) and note.exists():
                        unreachable[f"{pid}"] = int(note.read_text())
                collected[n] = tree_rss(s.proc.pid)
                collected_each[n] = by_process(s.proc.pid)
        report = {"requests": args.requests, "data_url_mb": round(mb, 2), "flood_s": round(flood_s, 1),
                  "statuses": {str(c): statuses.count(c) for c in set(statuses)},
                  "rss_mib": {n: {"after_warmup": warm[n], "after_flood_idle": idle[n],
                                  "after_gdb_trim": trimmed.get(n), "after_gc_and_trim": collected.get(n)}
                              for n in services},
                  "per_process_mib": {n: {"after_warmup": warm_each[n], "after_flood_idle": idle_each[n],
                                          "after_gdb_trim": trimmed_each.get(n),
                                          "after_gc_and_trim": collected_each.get(n)} for n in services},
                  "unreachable_objects_collected": unreachable, "errors": errors[:4]}
        print(json.dumps(report, indent=1))
    finally:
        for s in (gateway, decoder, encoder):
            if s is not None:
                s.stop()


if __name__ == "__main__":
    main()
