"""`--model DIR` or `--preset NAME` for the micro-benchmarks: a checkpoint directory either way."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --preset, --device, --dtype."""
    p.add_argument("--model", default=None, help="checkpoint dir (wins over --preset)")
    p.add_argument("--preset", default="tiny", help="tiny, small or llava-1.5-7b: made once in "
                   "$MMSERVE_HOME/models when --model is not given")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")


def resolve_model(args: argparse.Namespace) -> Path:
    """args.model, or the preset's checkpoint (made on first use, like `mmserve up`)."""
    from common.launcher import default_home
    from common.model_maker import make_model

    if args.model:
        return Path(args.model)
    path = default_home() / "models" / args.preset
    if not (path / "mmserve_model.json").exists():
        make_model(args.preset, path, device=args.device)
    return path
