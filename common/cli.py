"""The `mmserve` command line.

    mmserve up                         both services on the tiny model (made on first use)
    mmserve encoder --model DIR ...    the encoder service
    mmserve decoder --model DIR --encoder HOST:PORT ...
    mmserve gateway --decoder HOST:PORT   OpenAI-compatible HTTP API (gateway/)
    mmserve generate --prompt TEXT [--image PATH ...]
    mmserve stats HOST:PORT            either service's stats, as JSON
    mmserve health HOST:PORT           exit 0 when SERVING
    mmserve make-model --preset tiny --out DIR
    mmserve bench ...                  load generator (bench/serve.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from common.arg_types import (  # noqa: F401 - the argparse types, re-exported for the commands
    dtype_name,
    int_in_range,
    model_dir,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from common.errors import UsageError
from common.help_format import DefaultsHelpFormatter
from common.startup import report_usage_error

# Subcommands whose arguments belong to another module: (module, what to call with argv).
_DELEGATED = {
    "encoder": "encoder_svc.main",
    "decoder": "decoder_svc.main",
    "up": "common.launcher",
    "gateway": "gateway.main",
    "bench": "bench.serve",
}


def image_arg(text: str) -> str:
    """An argparse type: a readable image file, or `hash:<hex>` (a content hash the encoder holds)."""
    if text.startswith("hash:"):
        return text
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror}") from None
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory to write into (made when missing); not an existing file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def preset_name(text: str) -> str:
    """An argparse type: a model_maker preset name."""
    from common.model_maker import preset_names  # imports torch: only make-model parses this

    if text not in preset_names():
        names = ", ".join(preset_names())
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose one of {names}")
    return text


def _preset_names() -> list[str]:
    """Every make-model preset, family by family (common/families/registry.py)."""
    from common.model_maker import preset_names  # imports torch: only make-model reads them

    return preset_names()


def _cmd_make_model(args: argparse.Namespace) -> int:
    from common.model_maker import make_model
    from common.quiet import transformers_errors_only

    with transformers_errors_only():
        out = make_model(args.preset, args.out, seed=args.seed, device=args.device, dtype=args.dtype,
                         weights=args.weights)
    print(out)
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from common.health import health_status

    status = health_status(args.address, service=args.service, timeout=args.timeout,
                           tls=_client_security(args, sends_token=False).tls)
    print(status)
    return 0 if status == "SERVING" else 1


def _message_fields(message) -> dict:
    """A stats message as plain JSON values, every field written (zeros too): map fields as objects,
    repeated messages (the decoder's kv_groups) as lists of objects."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if hasattr(value, "items"):
            value = dict(value)
        elif f.message_type is not None and hasattr(value, "add"):
            value = [_message_fields(item) for item in value]
        out[f.name] = value
    return out


def _cmd_stats(args: argparse.Namespace) -> int:
    import grpc

    from common.client import DecoderClient, EncoderClient

    security = _client_security(args)
    for client_cls in (DecoderClient, EncoderClient):
        with client_cls(args.address, timeout=args.timeout, tls=security.tls, token=security.token) as client:
            try:
                stats = client.stats()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                print(f"error: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        kind = "decoder" if client_cls is DecoderClient else "encoder"
        print(json.dumps({"service": kind, **_message_fields(stats)}, indent=2))
        return 0
    print(f"error: {args.address} serves neither DecoderService nor EncoderService", file=sys.stderr)
    return 1


def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from common.client import DecoderClient, GenerationResult

    prompt = args.prompt.replace("\\n", "\n")
    if args.chat:
        content = [{"type": "image", "image": p} for p in args.image] + [{"type": "text", "text": prompt}]
        kwargs = {"chat": [{"role": "user", "content": content}]}
        prompt_arg, images = None, ()
    else:
        if args.image and "<image>" not in prompt:
            prompt = "<image>\n" * len(args.image) + prompt
        kwargs, prompt_arg, images = {}, prompt, args.image
    result = GenerationResult()
    security = _client_security(args)
    with DecoderClient(args.addr, timeout=args.timeout, tls=security.tls, token=security.token) as client:
        try:
            for chunk in client.generate(
                    prompt_arg, images, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, lora_adapter=args.lora_adapter,
                    **kwargs):
                result.add(chunk)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if args.usage and result.usage is not None:
        from google.protobuf.json_format import MessageToDict

        usage = MessageToDict(result.usage, always_print_fields_with_no_presence=True,
                              preserving_proto_field_name=True)
        print(json.dumps({"finish_reason": result.finish_reason, "usage": usage}), file=sys.stderr)
    return 0


def _client_security(args: argparse.Namespace, sends_token: bool = True):
    """TLS and token from the client flags (common/security/options.py); exits 2 on a bad file, or on a
    token that would go in plaintext off loopback (sends_token False: health, which sends none)."""
    from common.security.options import client_security_from_args

    target = getattr(args, "address", None) or getattr(args, "addr", None)
    return client_security_from_args(args, targets=[target] if sends_token and target else [])


def _add_client_security_args(p: argparse.ArgumentParser) -> None:
    from common.security.options import add_client_args

    add_client_args(p)


def build_parser(presets: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of the commands not delegated to another module. `presets`: the make-model presets its
    --preset help lists (the registry's, read only for make-model: reading them imports torch)."""
    parser = argparse.ArgumentParser(prog="mmserve", description="Disaggregated serving for VLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _DELEGATED.items():
        sub.add_parser(name, help=f"see `mmserve {name} --help` ({module})", add_help=False)

    p = sub.add_parser("make-model", help="write a random checkpoint of a served model family in HF format")
    listed = ", ".join(presets) if presets else "see `mmserve make-model --help`"
    p.add_argument("--preset", type=preset_name, default="tiny",
                   help=f"a preset of one of the served families, all random weights: {listed}")
    p.add_argument("--out", type=output_dir, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where to initialise (default: cuda if present)")
    p.add_argument("--dtype", type=dtype_name, default=None, help="float32, float16 or bfloat16")
    p.add_argument("--weights", choices=("all", "vision"), default="all",
                   help="vision: write only the vision tower's weights (the presets whose family can), for "
                   "language models too large to write; serve the decoder with --load-format dummy")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("health", help="exit 0 when HOST:PORT reports SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    p.add_argument("--timeout", type=positive_float, default=3.0)
    _add_client_security_args(p)
    p.set_defaults(func=_cmd_health)

    p = sub.add_parser("stats", help="print a service's stats as JSON")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--timeout", type=positive_float, default=10.0)
    _add_client_security_args(p)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("generate", help="stream a generation to stdout",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--addr", default="127.0.0.1:50052", help="decoder address (`mmserve up` serves one here)")
    p.add_argument("--prompt", required=True,
                   help='text; "<image>" marks each image (added in front when missing); \\n is a newline')
    p.add_argument("--image", action="append", type=image_arg, default=[],
                   help="image file, or hash:<hex> for one the encoder holds (repeatable)")
    p.add_argument("--chat", action="store_true", help="send as one user chat message (chat template)")
    # Ranges are the proto fields' (uint32, int32, uint64): out of range, the request cannot be built.
    p.add_argument("--max-tokens", type=int_in_range(0, 2**32 - 1), default=64, help="0: server default")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int_in_range(0, 2**31 - 1), default=0)
    p.add_argument("--seed", type=int_in_range(0, 2**64 - 1), default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--cache-salt", default="")
    p.add_argument("--lora-adapter", default="", metavar="NAME",
                   help="one of the decoder's --lora-modules adapters (default: the base model)")
    p.add_argument("--timeout", type=positive_float, default=300.0)
    p.add_argument("--usage", action="store_true", help="print finish reason and usage to stderr")
    _add_client_security_args(p)
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import asyncio
        import importlib
        import inspect

        try:
            module = importlib.import_module(_DELEGATED[argv[0]])
        except ModuleNotFoundError as exc:
            if exc.name != "bench":
                raise
            # bench/ is not in the installed package (pyproject.toml): it runs from a source checkout.
            return report_usage_error(f"mmserve {argv[0]}", UsageError(
                "the benchmarks are not installed; run `mmserve bench` (or python -m bench.serve) from a "
                "source checkout of mmserve"))
        if hasattr(module, "main"):
            return int(module.main(argv[1:]) or 0)
        result = module.run(module.build_arg_parser().parse_args(argv[1:]))
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    parser = build_parser(_preset_names() if argv[:1] == ["make-model"] else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:  # e.g. an unreadable --tls-ca or --token-file
        return report_usage_error(f"{parser.prog} {args.command}", exc)


if __name__ == "__main__":
    sys.exit(main())
