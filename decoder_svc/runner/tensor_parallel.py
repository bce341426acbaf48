"""Tensor-parallel steps: the engine's process is rank 0; one worker process per other rank holds its
shard of the model and KV cache (decoder_svc/runner/tp_worker.py).

The scheduler, the block tables and sampling stay on rank 0. Each step rank 0 broadcasts the step's
ModelInput as plain data on a gloo group and its image rows as one tensor on the default group (NCCL on
GPUs: runner/step_rows.py), then every rank runs the same ModelRunner.execute on its shard: the layers'
all-reduces and the logits' all-gather keep them in step, and every rank computes the same logits (the
workers' samples are dropped).

Workers are started as subprocesses (the engine core is a daemonic process, which multiprocessing does
not let have children) and watched: a rank that dies ends rank 0's process (exit code 3) with a log line
saying which, so the decoder's front end turns NOT_SERVING and exits instead of hanging in a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from decoder_svc.runner.inputs import ModelInput
from decoder_svc.runner.step_rows import broadcast_rows, split_rows

if TYPE_CHECKING:
    from decoder_svc.engine.config import EngineConfig
    from decoder_svc.runner.model_runner import ModelRunner

log = logging.getLogger("mmserve.decoder.tp")

RANK_DIED_EXIT_CODE = 3
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a model load or first compile on a peer may take long


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard and join the group."""

    config: EngineConfig
    rank: int
    size: int
    init_method: str
    mm_token_ids: list[int]


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` computes on: cuda:rank on GPUs (CUDA_VISIBLE_DEVICES picks them), else cpu."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def init_group(spec: WorkerSpec) -> Any:
    """Join the default process group (NCCL on GPUs, gloo on CPU); returns the gloo group that carries
    the step broadcasts (the default group itself on CPU)."""
    cuda = torch.device(spec.config.device).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=spec.init_method, rank=spec.rank,
                            world_size=spec.size, timeout=_COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo") if cuda else dist.group.WORLD


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's side: the worker processes, the control group, and the watch over the workers."""

    def __init__(self, config: EngineConfig, mm_token_ids: list[int]) -> None:
        self.size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.workers: list[subprocess.Popen] = []
        self._stopping = False
        for rank in range(1, self.size):
            with tempfile.NamedTemporaryFile("wb", suffix=".tp", delete=False) as f:
                pickle.dump(WorkerSpec(config, rank, self.size, init_method, mm_token_ids), f)
            self.workers.append(subprocess.Popen([sys.executable, "-m", "decoder_svc.runner.tp_worker",
                                                  f.name]))
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        self.control = init_group(WorkerSpec(config, 0, self.size, init_method, mm_token_ids))
        _CONTROL[0] = self.control

    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    log.error("tensor-parallel rank %d exited with code %s; the decoder cannot go on without "
                              "it: exiting", rank, code)
                    logging.shutdown()
                    os._exit(RANK_DIED_EXIT_CODE)
            time.sleep(0.2)

    def send(self, message: tuple) -> None:
        """Broadcast a message to every worker (rank 0's side of tp_worker's loop)."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self.send(("stop",))
        except Exception:  # noqa: BLE001 - a broken group: the workers are killed below
            pass
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


# This process's gloo control group (set when it joins): host-side collectives use it on GPU hosts too.
_CONTROL: list[Any] = [None]


def agree_on_blocks(local: int) -> int:
    """The KV block count every rank can hold (the smallest): their block tables are the same."""
    count = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=_CONTROL[0])
    return int(count.item())


class TensorParallelRunner:
    """Rank 0's ModelRunner: every call it makes on its shard is first announced to the workers."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup) -> None:
        self.runner, self.group = runner, group
        runner.agree_blocks = agree_on_blocks

    def initialize(self):
        """Every rank sizes its KV cache (to the smallest count), then warms up and captures together."""
        self.group.send(("init",))
        return self.runner.initialize()

    def execute(self, batch: ModelInput):
        """One step on every rank; rank 0's sampled tokens."""
        plain, layout, packed = split_rows(batch)
        self.group.send(("step", plain, layout))
        if packed is not None:
            broadcast_rows(packed)
        return self.runner.execute(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)
