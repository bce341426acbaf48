"""How a step's image rows reach tensor-parallel workers: pickled inside the step, or packed as one tensor.

    python -m bench.tp_rows [--device cuda] [--images 1,4] [--rows 1225 --hidden 3584] [--out rows.json]

Two ranks (processes) on one host. "pickled" is what the decoder did first: rank 0 moves each image's rows
to the host and the whole ModelInput goes through broadcast_object_list on gloo. "packed" is what it does
now (decoder_svc/runner/step_rows.py): the step without rows through broadcast_object_list, the rows as
one uint8 tensor through dist.broadcast on the default group (gloo on CPU; NCCL from GPU to GPU with
--device cuda, which needs two GPUs). Per step: the time from rank 0's first send until rank 1 holds the
rows on its device, median over --iters steps. The default shape is one 1024x1024 Qwen2.5-VL-7B image.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.report import print_table, save_result
from bench.stats import summarize
from decoder_svc.runner.inputs import ModelInput, SequenceInput
from decoder_svc.runner.step_rows import broadcast_rows, receive_rows, split_rows


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the row-broadcast benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.tp_rows", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", default="1,4", help="images per step, comma-separated")
    p.add_argument("--rows", type=int, default=1225, help="embedding rows per image")
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    return p


def _step(images: int, rows: int, hidden: int, device: str) -> ModelInput:
    def image() -> torch.Tensor:
        return torch.randn(rows, hidden, device=device).to(torch.bfloat16)

    seqs = [SequenceInput(list(range(rows)), 0, list(range(rows // 16 + 1)), rows + 8, [image()])
            for _ in range(images)]
    return ModelInput(seqs)


def _device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    device = _device(args.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    control = dist.new_group(backend="gloo") if args.device == "cuda" else dist.group.WORLD
    results = []
    for images in [int(n) for n in args.images.split(",")]:
        batch = _step(images, args.rows, args.hidden, device) if rank == 0 else None
        for way in ("pickled", "packed"):
            times = []
            for _ in range(args.iters + 2):  # two warm-up steps
                dist.barrier(group=control)
                start = time.perf_counter()
                if rank == 0:
                    if way == "pickled":
                        host = ModelInput([dataclasses.replace(s, image_rows=[r.cpu() for r in s.image_rows])
                                           for s in batch.sequences])
                        dist.broadcast_object_list([("step", host)], src=0, group=control)
                    else:
                        plain, layout, packed = split_rows(batch)
                        dist.broadcast_object_list([("step", plain, layout)], src=0, group=control)
                        broadcast_rows(packed)
                else:
                    box = [None]
                    dist.broadcast_object_list(box, src=0, group=control)
                    if way == "pickled":
                        got = [r.to(device) for s in box[0][1].sequences for r in s.image_rows]
                    else:
                        got = receive_rows(box[0][1], box[0][2], device).sequences
                    _sync(device)
                    assert len(got) == images
                dist.barrier(group=control)
                times.append(time.perf_counter() - start)
            if rank == 0:
                mb = images * args.rows * args.hidden * 2 / 1e6
                results.append({"images": images, "way": way, "mb": mb, "ms": summarize(times[2:])})
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    """Run both ranks, print the table, save the JSON."""
    args = build_arg_parser().parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    rows = [[r["images"], f"{r['mb']:.1f}", r["way"], f"{r['ms']['p50_ms']:.2f}", f"{r['ms']['mean_ms']:.2f}"]
            for r in results]
    print_table(f"image rows to rank 1 ({args.device})", ["images", "MB", "way", "p50 ms", "mean ms"], rows)
    by = {(r["images"], r["way"]): r["ms"]["p50_ms"] for r in results}
    speedups = {n: by[(n, "pickled")] / by[(n, "packed")] for n, _ in by}
    headline = [[f"TP rows to rank 1, {n} image(s): pickled / packed p50", round(v, 2)]
                for n, v in speedups.items()]
    return save_result("tp_rows", args, results, headline=headline)


if __name__ == "__main__":
    main()
