"""`mmserve gateway`: the OpenAI-compatible HTTP front end, on uvicorn.

    mmserve gateway --decoder 127.0.0.1:50052 [--decoder ...] [--host 127.0.0.1] [--port 8000]
                    [--served-model-name NAME] [--api-key KEY ...] [--model DIR] [--allow-private-image-urls]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from common.arg_types import model_dir, port_number, positive_float, positive_int
from common.errors import UsageError
from common.startup import check_port_free, report_usage_error
from gateway.config import GatewayConfig
from gateway.images import ImageFetchPolicy

API_KEY_ENV = "MMSERVE_API_KEY"  # keys from the environment stay out of `ps` output


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmserve gateway",
                                description="OpenAI-compatible HTTP API over one or more decoders.")
    p.add_argument("--decoder", action="append", required=True, metavar="HOST:PORT",
                   help="a decoder's gRPC address (repeatable: balanced by least outstanding requests)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model's directory "
                        "name, else 'mmserve')")
    p.add_argument("--model", type=model_dir, default=None,
                   help="the served checkpoint dir: its tokenizer writes logprob tokens as text "
                        "(without it they read token_id:N)")
    p.add_argument("--api-key", action="append", default=[],
                   help=f"accept this bearer key (repeatable; also ${API_KEY_ENV}); each key is a tenant "
                        "with its own prefix and embedding cache. Default: no authentication")
    p.add_argument("--allow-private-image-urls", action="store_true",
                   help="also fetch image URLs on loopback, private and link-local addresses")
    p.add_argument("--image-fetch-timeout", type=positive_float, default=10.0, help="seconds per image URL")
    p.add_argument("--max-image-bytes", type=positive_int, default=20 * 2**20)
    p.add_argument("--max-request-bytes", type=positive_int, default=64 * 2**20)
    p.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="deadline of each decoder call in seconds (then 504)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    keys = list(args.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    name = args.served_model_name or (Path(args.model).name if args.model else "mmserve")
    return GatewayConfig(
        decoders=list(args.decoder), served_model_name=name, api_keys=keys,
        model_dir=Path(args.model) if args.model else None, request_timeout_s=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        images=ImageFetchPolicy(max_bytes=args.max_image_bytes, timeout_s=args.image_fetch_timeout,
                                allow_private=args.allow_private_image_urls))


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Exit codes: 0 after a clean stop, 2 for a user error."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_port_free(args.host, args.port)
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
    import uvicorn

    from gateway.app import build_app

    config = config_from_args(args)
    app = build_app(config)
    print(f"gateway serving {config.served_model_name!r} at http://{args.host}:{args.port}/v1 over "
          f"{', '.join(config.decoders)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
