"""A tensor-parallel worker: rank r > 0 of the decoder's model (started by runner/tensor_parallel.py).

    python -m decoder_svc.runner.tp_worker SPEC_FILE

It loads its shard, then follows rank 0's broadcasts: "init" (size the KV cache, warm up, capture
graphs), "step" (run the same ModelRunner.execute on its shard), "stop". It ends with its parent: the
kernel sends it SIGTERM when the parent dies (Linux), and a broken collective raises.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from common.checkpoint import parse_dtype
from decoder_svc.model import load_language_model
from decoder_svc.model.parallel import TensorParallel
from decoder_svc.runner.model_runner import ModelRunner, RunnerConfig
from decoder_svc.runner.step_rows import receive_rows
from decoder_svc.runner.tensor_parallel import WorkerSpec, agree_on_blocks, init_group, rank_device
from decoder_svc.tokenization import PromptTokenizer

log = logging.getLogger("mmserve.decoder.tp")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: a broken collective still ends the worker


def run(spec: WorkerSpec) -> None:
    """The worker's life: join, load, follow rank 0 until told to stop."""
    import decoder_svc.runner.tensor_parallel as tp_module

    cfg = spec.config
    device = rank_device(cfg.device, spec.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    control = init_group(spec)
    tp_module._CONTROL[0] = control
    dtype = parse_dtype(cfg.dtype)
    model = load_language_model(cfg.model, device, dtype, cfg.attention_backend, cfg.quantization,
                                cfg.load_format, tp=TensorParallel(spec.rank, spec.size),
                                lora_modules=cfg.lora_adapters,
                                merge_builtin_adapter=cfg.merge_builtin_adapter)
    layout = PromptTokenizer(cfg.model).layout
    config = RunnerConfig.for_engine(cfg, device, dtype, layout, eager=True)
    runner = ModelRunner(model, dataclasses.replace(config, progress=False), spec.mm_token_ids)
    runner.agree_blocks = agree_on_blocks
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        message = box[0]
        if message[0] == "init":
            runner.initialize()
        elif message[0] == "step":
            _, batch, layout = message
            runner.execute(batch if layout is None else receive_rows(batch, layout, device))
        else:
            break
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Read the spec file (deleted once read) and run."""
    _die_with_parent()
    path = (argv or sys.argv[1:])[0]
    with open(path, "rb") as f:
        spec = pickle.load(f)
    os.unlink(path)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(message)s")
    run(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
