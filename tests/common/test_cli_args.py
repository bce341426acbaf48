"""The CLI's argument types and start-up checks (common/cli.py, common/startup.py), in process."""

from __future__ import annotations

import argparse
import asyncio
import socket

import pytest

from common.arg_types import (
    dtype_name,
    int_in_range,
    model_dir,
    positive_float,
    positive_int,
    require_local_weights,
)
from common.cli import image_arg
from common.errors import UsageError
from common.server import GrpcService
from common.startup import check_port_free, start_listening
from tests.cli_errors import busy_port, decoy_model


def test_int_types():
    assert positive_int("3") == 3 and int_in_range(0, 5)("5") == 5
    cases = (("0", positive_int), ("6", int_in_range(0, 5)), ("1.5", positive_int), ("", positive_int))
    for bad, parse in cases:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "x"])
def test_positive_float_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(text)


def test_dtype_name_is_the_canonical_torch_name():
    assert dtype_name("fp16") == "float16" and dtype_name("BF16") == "bfloat16"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown dtype 'float64x'"):
        dtype_name("float64x")


def test_model_dir_and_image_arg(tmp_path):
    assert model_dir(str(decoy_model(tmp_path / "m"))) == str(tmp_path / "m")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text("{}")
    assert model_dir(str(tmp_path / "w")) == str(tmp_path / "w")  # weights: the services' configs check
    with pytest.raises(ValueError, match="--model: .* has no \\*.safetensors"):
        require_local_weights(str(tmp_path / "w"))
    with pytest.raises(argparse.ArgumentTypeError, match="no config.json"):
        model_dir(str(tmp_path))
    assert image_arg("hash:abc") == "hash:abc"  # a content hash is not a file
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        image_arg(str(tmp_path / "x.png"))


def test_check_port_free():
    check_port_free("127.0.0.1", 0)  # 0: the service picks one
    with busy_port() as port:
        with pytest.raises(UsageError, match=f"--port {port}: 127.0.0.1:{port} is already in use"):
            check_port_free("127.0.0.1", port)
    with socket.socket() as sock:  # bound, closed: free again
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    check_port_free("127.0.0.1", port)
    with pytest.raises(UsageError, match="--host no-such-host.invalid"):
        check_port_free("no-such-host.invalid", 5000)


def test_start_listening_turns_a_bind_race_into_a_usage_error():
    async def main() -> None:
        with busy_port() as port:
            service = GrpcService("test", "127.0.0.1", port)
            with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port}"):
                await start_listening(service)

    asyncio.run(main())


def test_make_model_help_lists_every_registry_preset(monkeypatch, capsys):
    """`mmserve make-model --help` lists the registry's presets, all of them and in its order."""
    import re

    from common.cli import main
    from common.families.registry import preset_names

    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: a name is never wrapped at a hyphen
    with pytest.raises(SystemExit) as exit_info:
        main(["make-model", "--help"])
    assert exit_info.value.code == 0
    listed = re.search(r"--preset PRESET\s+.*random weights: (.*)", capsys.readouterr().out)
    assert listed is not None
    assert listed.group(1).split(", ") == preset_names()
    assert {"phi-4-mm", "gemma-3-4b", "qwen3-vl-8b", "qwen2.5-vl-7b", "llava-1.5-7b"} <= set(preset_names())
