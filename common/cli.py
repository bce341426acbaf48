"""The `mmserve` command line.

    mmserve up                         both services on the tiny model (made on first use)
    mmserve encoder --model DIR ...    the encoder service
    mmserve decoder --model DIR --encoder HOST:PORT ...
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

# Subcommands whose arguments belong to another module: (module, what to call with argv).
_DELEGATED = {
    "encoder": "encoder_svc.main",
    "decoder": "decoder_svc.main",
    "up": "common.launcher",
    "bench": "bench.serve",
}


def _cmd_make_model(args: argparse.Namespace) -> int:
    from common.model_maker import make_model

    out = make_model(args.preset, args.out, seed=args.seed, device=args.device, dtype=args.dtype)
    print(out)
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from common.health import health_status

    status = health_status(args.address, service=args.service, timeout=args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


def _cmd_stats(args: argparse.Namespace) -> int:
    import grpc

    from common.client import DecoderClient, EncoderClient

    for client_cls in (DecoderClient, EncoderClient):
        with client_cls(args.address, timeout=args.timeout) as client:
            try:
                stats = client.stats()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                print(f"error: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        kind = "decoder" if client_cls is DecoderClient else "encoder"
        fields = {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}
        fields = {k: dict(v) if hasattr(v, "items") else v for k, v in fields.items()}  # map fields
        print(json.dumps({"service": kind, **fields}, indent=2))
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
    with DecoderClient(args.addr, timeout=args.timeout) as client:
        try:
            for chunk in client.generate(
                    prompt_arg, images, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, **kwargs):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description="Disaggregated serving for VLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _DELEGATED.items():
        sub.add_parser(name, help=f"see `mmserve {name} --help` ({module})", add_help=False)

    p = sub.add_parser("make-model", help="write a random LLaVA checkpoint in HF format")
    p.add_argument("--preset", default="tiny", help="tiny, small or llava-1.5-7b")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where to initialise (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("health", help="exit 0 when HOST:PORT reports SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=_cmd_health)

    p = sub.add_parser("stats", help="print a service's stats as JSON")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("generate", help="stream a generation to stdout")
    p.add_argument("--addr", default="127.0.0.1:50052", help="decoder address")
    p.add_argument("--prompt", required=True,
                   help='text; "<image>" marks each image (added in front when missing); \\n is a newline')
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--chat", action="store_true", help="send as one user chat message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--cache-salt", default="")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--usage", action="store_true", help="print finish reason and usage to stderr")
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import asyncio
        import importlib
        import inspect

        module = importlib.import_module(_DELEGATED[argv[0]])
        if hasattr(module, "main"):
            return int(module.main(argv[1:]) or 0)
        result = module.run(module.build_arg_parser().parse_args(argv[1:]))
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
