"""`mmserve gateway`: the OpenAI-compatible HTTP front end, on uvicorn.

    mmserve gateway --decoder 127.0.0.1:50052 [--decoder ...] [--host 127.0.0.1] [--port 8000]
                    [--served-model-name NAME ...] [--api-key KEY ...] [--model DIR]
                    [--tls-ca PEM [--tls-cert PEM --tls-key PEM]] [--token-file FILE]

The flags are generated from GatewayConfig (gateway/config.py); the upstream security flags are the
clients' (common/security/options.py), so `export MMSERVE_TLS_CA=... MMSERVE_TOKEN_FILE=...` works here
as it does for `mmserve generate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from common.config import add_options, from_args
from common.errors import UsageError
from common.security.options import add_client_args, client_security_from_args
from common.startup import check_port_free, report_usage_error
from gateway.config import GatewayConfig

API_KEY_ENV = "MMSERVE_API_KEY"  # keys from the environment stay out of `ps` output


def build_arg_parser() -> argparse.ArgumentParser:
    """`mmserve gateway`'s parser: GatewayConfig's options plus the client security flags."""
    p = argparse.ArgumentParser(prog="mmserve gateway",
                                description="OpenAI-compatible HTTP API over one or more decoders.")
    add_options(p, GatewayConfig)
    add_client_args(p, what="the decoders")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config from parsed flags; raises UsageError (a bad combination or an unusable file)."""
    keys = list(args.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    upstream = client_security_from_args(args, targets=args.decoder)
    try:
        return from_args(GatewayConfig, args, api_keys=keys, upstream=upstream)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def serve(config: GatewayConfig) -> None:
    """Run uvicorn with the config's connection limits until SIGINT/SIGTERM."""
    import uvicorn

    from gateway.app import build_app
    from gateway.http_server import header_timeout_protocol

    app = build_app(config)
    scheme = "TLS" if config.upstream.tls else "plaintext"
    names = ", ".join(repr(n) for n in config.served_model_names)
    print(f"gateway serving {names} at http://{config.host}:{config.port}/v1 over "
          f"{', '.join(config.decoders)} ({scheme} gRPC{', token' if config.upstream.token else ''})",
          flush=True)
    limits = config.http
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                timeout_graceful_shutdown=30, timeout_keep_alive=limits.keep_alive_s,
                limit_concurrency=limits.max_connections,
                h11_max_incomplete_event_size=limits.max_header_bytes,
                http=header_timeout_protocol(limits.header_timeout_s))


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Exit codes: 0 after a clean stop, 2 for a user error."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        check_port_free(config.host, config.port)
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
