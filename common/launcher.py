"""`mmserve up`: both services as child processes, healthy before it says so, stopped together; and the
OpenAI-compatible gateway in front of them (`--no-gateway` leaves it out).

The tiny model is made on first use in a cache dir ($MMSERVE_HOME, default ~/.cache/mmserve), so a new
user gets a working pair with one command and no downloads.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from common.arg_types import (
    device_name,
    dtype_name,
    int_in_range,
    lora_module,
    lora_modules_dict,
    model_dir,
    positive_float,
)
from common.devices import resolve_device, resolve_dtype
from common.errors import UsageError
from common.health import wait_until_serving
from common.help_format import DefaultsHelpFormatter
from common.startup import check_port_free, report_usage_error
from gateway.health import wait_until_http_healthy
from gateway.model_info import default_served_names


def random_weights_note(model: Path) -> str:
    """What `up` says after serving a model-maker checkpoint: its text is noise, and the command that
    serves a real model of the same family (device and dtype are picked by auto: no flags needed)."""
    from common.checkpoint import load_config
    from common.families import find_family
    from common.families.registry import FALLBACK_LAYOUT_FAMILY

    try:
        family = find_family(load_config(model))
    except Exception:  # noqa: BLE001 - an unreadable config: the note still says what matters
        family = None
    # a checkpoint of no known family: the fallback family's real checkpoint is the hint
    real = (family or FALLBACK_LAYOUT_FAMILY).real_checkpoint
    return ("note: this checkpoint was made by `mmserve make-model` with random weights: its text is noise "
            f"by design.\n  To serve a real model: mmserve up --model {real}")


def default_home() -> Path:
    return Path(os.environ.get("MMSERVE_HOME", Path.home() / ".cache" / "mmserve"))


def ensure_model(model: str | None, preset: str = "tiny", revision: str | None = None) -> Path:
    """The checkpoint to serve: the given dir or Hub id (resolved once here, so both services load the
    same snapshot), or the preset made once into the cache dir.

    Raises UsageError for a directory that is not a checkpoint, a Hub model that cannot be had, or a
    preset model_maker does not know.
    """
    if model:
        from common.hub import ModelNotFoundError, resolve_model

        try:
            return resolve_model(model, revision)
        except ModelNotFoundError as exc:
            raise UsageError(f"--model: {exc}") from None
    path = default_home() / "models" / preset
    if not (path / "mmserve_model.json").exists():
        # Checked only here: importing model_maker (torch) just to check a name would slow every start.
        from common.model_maker import make_model, preset_names

        if preset not in preset_names():
            names = ", ".join(preset_names())
            raise UsageError(f"--preset: unknown preset {preset!r}; choose one of {names}")

        print(f"making the {preset} model in {path} (first use only)", flush=True)
        from common.quiet import transformers_errors_only

        with transformers_errors_only():
            make_model(preset, path, device="cpu")
    return path


class _UpParser(argparse.ArgumentParser):
    """`mmserve up`'s parser: --help lists the presets, read from the model maker only when help is
    shown (it imports torch, which starting `up` does not otherwise need)."""

    def format_help(self) -> str:
        from common.model_maker import preset_names

        for action in self._actions:
            if action.dest == "preset":
                action.help = f"preset made when --model is not given: {', '.join(preset_names())}"
        return super().format_help()


def build_arg_parser() -> argparse.ArgumentParser:
    """`mmserve up`'s flags; --help shows each default."""
    p = _UpParser(prog="mmserve up", description="Run the encoder, the decoder and the OpenAI gateway "
                  "together.", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", type=model_dir, default=None,
                   help="checkpoint dir or Hugging Face Hub id (default: the tiny preset, made on first use; "
                   "random weights, so its text is noise)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit for a Hub id --model")
    p.add_argument("--preset", default="tiny", help="preset made when --model is not given")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) OpenAI clients send (default: --model as typed, and for a "
                   "directory also its name; the preset's name without --model)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   type=lora_module, help="LoRA adapters (PEFT directories) served per request: the decoder "
                   "loads them, the gateway serves each as a model name (README: LoRA adapters); vLLM's "
                   "JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' too "
                   "(base_model_name: the gateway's card parent). A name given twice is refused")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant serving on the encoder and the decoder (both services' "
                   "--deterministic): the same request gives the same tokens and logprobs whatever else is "
                   "served beside it; costs throughput")
    p.add_argument("--host", default="127.0.0.1", help="bind address of both services")
    # Real ports (not 0): the decoder is told the encoder's address, and both are printed.
    p.add_argument("--encoder-port", type=int_in_range(1, 65535), default=50051, help="encoder gRPC port")
    p.add_argument("--decoder-port", type=int_in_range(1, 65535), default=50052, help="decoder gRPC port")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", type=dtype_name, default="auto",
                   help="auto (the checkpoint's dtype on a GPU, float32 on CPU), float32, float16 or "
                   "bfloat16")
    p.add_argument("--startup-timeout", type=positive_float, default=300.0,
                   help="seconds each service has to become healthy")
    p.add_argument("--encoder-arg", action="append", default=[], help="extra argument for the encoder")
    p.add_argument("--decoder-arg", action="append", default=[], help="extra argument for the decoder")
    p.add_argument("--tls", action="store_true",
                   help="TLS and bearer tokens on both services, mutual TLS between them; certificates and "
                   "a token made on first use in $MMSERVE_HOME/tls (docs/security.md)")
    p.add_argument("--gateway-port", type=int_in_range(1, 65535), default=8000,
                   help="port of the OpenAI-compatible HTTP gateway")
    p.add_argument("--no-gateway", action="store_true", help="do not start the gateway")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for the gateway")
    return p


def served_names(args: argparse.Namespace) -> list[str]:
    """The names the gateway serves: --served-model-name, else --model as the user typed it (a Hub id; a
    directory as typed and its name), else the preset's name."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        return default_served_names(args.model)
    return [args.preset]


def up_banner(model: Path, names: list[str], device: str, dtype: str, decoder_addr: str, encoder_addr: str,
              gateway_url: str | None) -> str:
    """What `up` prints once everything is healthy: what is served where, and the next commands."""
    shown = ", ".join(repr(n) for n in names)
    lines = [f"\nmmserve is up: {shown} on {device} in {dtype} (checkpoint {model}).",
             f"  mmserve generate --addr {decoder_addr} --chat --prompt 'What is in this picture?' "
             "--image PATH",
             f"  mmserve stats {decoder_addr}    mmserve stats {encoder_addr}"]
    if gateway_url is not None:
        lines.append(f"  OpenAI API: {gateway_url}/v1, model={names[0]!r}")
    lines.append("Ctrl-C stops them all.")
    return "\n".join(lines)


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "common.cli", *args])


def _stop_all(children: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Start both services, wait for SERVING, and stop both on a signal or when either exits.
    Exit codes: 0 after a clean stop, 1 when a service failed, 2 for a user error (one line on stderr)."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.encoder_port == args.decoder_port:
        parser.error(f"--encoder-port and --decoder-port are both {args.encoder_port}")
    if not args.no_gateway and args.gateway_port in (args.encoder_port, args.decoder_port):
        parser.error(f"--gateway-port {args.gateway_port} is also a service's port")
    try:
        lora_modules_dict(args.lora_modules)  # a name given twice: refused before anything starts
    except ValueError as exc:
        parser.error(str(exc))
    try:
        # Before making a model or starting anything: a busy port would otherwise show up as a
        # child's failure after its load.
        check_port_free(args.host, args.encoder_port, "--encoder-port")
        check_port_free(args.host, args.decoder_port, "--decoder-port")
        if not args.no_gateway:
            check_port_free(args.host, args.gateway_port, "--gateway-port")
        try:
            device = resolve_device(args.device)  # cuda on a CPU build of torch: one line, now
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        model = ensure_model(args.model, args.preset, args.revision)
        dtype = resolve_dtype(args.dtype, device, model)
    except UsageError as exc:
        return report_usage_error(parser.prog, exc)
    connect_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    encoder_addr = f"{connect_host}:{args.encoder_port}"
    decoder_addr = f"{connect_host}:{args.decoder_port}"
    security = None
    if args.tls:
        from common.security.local import ensure_local_security
        from common.security.tls import ClientTls

        extra = [] if args.host in ("0.0.0.0", "::") else [args.host]
        security = ensure_local_security(default_home() / "tls", extra)
        env = security.client_env()
        health_tls = {"encoder": ClientTls.from_files(env["MMSERVE_TLS_CA"], env["MMSERVE_TLS_CERT"],
                                                      env["MMSERVE_TLS_KEY"]),
                      "decoder": ClientTls.from_files(env["MMSERVE_TLS_CA"])}
    run_gateway = not args.no_gateway
    common = ["--model", str(model), "--host", args.host, "--device", device, "--dtype", dtype]
    names = served_names(args)
    children: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        encoder_argv = ["encoder", *common, "--port", str(args.encoder_port), *args.encoder_arg]
        decoder_argv = ["decoder", *common, "--port", str(args.decoder_port), "--encoder", encoder_addr,
                        *args.decoder_arg]
        if args.lora_modules:
            decoder_argv += ["--lora-modules", *args.lora_modules]
        if args.deterministic:
            encoder_argv.append("--deterministic")
            decoder_argv.append("--deterministic")
        if security is not None:
            encoder_argv += security.encoder_args()
            decoder_argv += security.decoder_args()
            gateway_security = security.gateway_args()
        else:
            gateway_security = []
        gateway_url = f"http://{connect_host}:{args.gateway_port}"
        gateway_argv = ["gateway", "--decoder", decoder_addr, "--host", args.host, "--port",
                        str(args.gateway_port), "--model", str(model), *gateway_security]
        if not any(a.startswith("--served-model-name") for a in args.gateway_arg):
            gateway_argv += ["--served-model-name", *names]
        if args.lora_modules:
            gateway_argv += ["--lora-modules", *args.lora_modules]
        gateway_argv += args.gateway_arg
        starts = [("encoder", encoder_argv, encoder_addr), ("decoder", decoder_argv, decoder_addr)]
        if run_gateway:
            starts.append(("gateway", gateway_argv, f"{gateway_url}/health"))
        for name, argv_child, addr in starts:
            child = _spawn(argv_child)
            children.append(child)
            alive = lambda c=child: c.poll() is None and not stopping  # noqa: E731
            if name == "gateway":
                ok = wait_until_http_healthy(addr, args.startup_timeout, is_alive=alive)
            else:
                ok = wait_until_serving(addr, args.startup_timeout, is_alive=alive,
                                        tls=health_tls[name] if security is not None else None)
            if not ok:
                if stopping:
                    return 0
                print(f"error: the {name} did not become healthy at {addr} "
                      f"(exit code {child.poll()}); see its log above", file=sys.stderr)
                return 1
            print(f"{name} serving at {addr}", flush=True)
        if security is not None:
            exports = " ".join(f"{k}={v}" for k, v in security.client_env().items())
            print(f"\nTLS and tokens are on; for the commands below, first:\n  export {exports}", flush=True)
        print(up_banner(model, names, device, dtype, decoder_addr, encoder_addr,
                        gateway_url if run_gateway else None), flush=True)
        if (model / "mmserve_model.json").exists():  # made by the model maker: say what that means
            print(random_weights_note(model), flush=True)
        while not stopping:
            for child in children:
                if child.poll() is not None:
                    print(f"error: a service exited with code {child.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(children)
