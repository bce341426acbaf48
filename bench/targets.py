"""Which services a benchmark talks to: running ones (--addr, --encoder) or a pair it spawns."""

from __future__ import annotations

import argparse
import contextlib
import shlex
from collections.abc import Iterator
from pathlib import Path

from bench.models import add_model_args, resolve_model
from bench.services import Pair


def add_target_args(p: argparse.ArgumentParser, default_addr: str | None = None) -> None:
    """--addr/--encoder, the model options, and extra flags for spawned services."""
    p.add_argument("--addr", default=default_addr, help="decoder address" +
                   ("" if default_addr else " (default: spawn a pair on the model)"))
    p.add_argument("--encoder", default=None, help="encoder address (for its cache hit rate)")
    add_model_args(p)
    p.add_argument("--encoder-args", default="", help='extra encoder flags when spawning, e.g. "--arena shm"')
    p.add_argument("--decoder-args", default="",
                   help='extra decoder flags when spawning, e.g. "--num-kv-blocks 512"')
    p.add_argument("--logs", default=None, help="directory for spawned services' logs")


def model_dir(args: argparse.Namespace, spawning: bool) -> Path | None:
    """The checkpoint dir when one is known (given, or needed to spawn); None for bare addresses."""
    if args.model or spawning:
        return resolve_model(args)
    return None


@contextlib.contextmanager
def target(args: argparse.Namespace, spawn: bool, decoder_args: str = "") -> Iterator[tuple[str, str | None]]:
    """(decoder, encoder) addresses: a pair spawned on the model when spawn, else --addr and --encoder."""
    if not spawn:
        yield args.addr, args.encoder
        return
    pair = Pair(resolve_model(args), args.device, args.dtype, shlex.split(args.encoder_args),
                shlex.split(f"{args.decoder_args} {decoder_args}"), args.logs).start()
    try:
        yield pair.decoder.address, pair.encoder.address
    finally:
        pair.stop()
