"""`--device auto` / `--dtype auto` (common/devices.py), and a device torch cannot use as one line."""

from __future__ import annotations

import json

import pytest
import torch

from common import devices
from common.devices import checkpoint_dtype, resolve_device, resolve_dtype
from tests.cli_errors import assert_usage_error, run_cli

needs_cpu_torch = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")


def _fake_torch(monkeypatch, version: str, available: bool, count: int) -> None:
    monkeypatch.setattr(devices, "_torch_cuda", lambda: (version, available, count))


def test_auto_picks_cuda_only_when_torch_sees_a_gpu(monkeypatch):
    _fake_torch(monkeypatch, "2.13.0+cu128", True, 2)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"--device cuda:2: this host has 2 GPU\(s\)"):
        resolve_device("cuda:2")
    _fake_torch(monkeypatch, "2.13.0+cpu", False, 0)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("CPU") == "cpu"


def test_cuda_on_a_cpu_build_says_what_to_do(monkeypatch):
    _fake_torch(monkeypatch, "2.13.0+cpu", False, 0)
    with pytest.raises(ValueError) as err:
        resolve_device("cuda")
    message = str(err.value)
    assert "\n" not in message and "CPU build" in message and "install a CUDA build of torch" in message
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoints_on_a_gpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "bfloat16"}}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert resolve_dtype("auto", "cpu", tmp_path) == "float32"
    assert resolve_dtype("auto", "cuda", tmp_path) == "bfloat16"
    assert resolve_dtype("float16", "cuda", tmp_path) == "float16"  # explicit wins
    assert resolve_dtype("auto", "cuda", "llava-hf/not-here-yet") == "auto"  # resolved after the download
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float64"}))
    assert resolve_dtype("auto", "cuda", tmp_path) == "float32"  # a dtype we do not serve


@needs_cpu_torch
def test_encoder_and_decoder_auto_pick_cpu_here_and_say_so(tiny_model_dir):
    for service in ("encoder", "decoder"):
        extra = ["--encoder", "127.0.0.1:1"] if service == "decoder" else []
        result = run_cli(service, "--model", str(tiny_model_dir), *extra, "--print-config")
        assert result.returncode == 0, result.stderr
        section = json.loads(result.stdout)["encoder" if service == "encoder" else "engine"]
        assert (section["device"], section["dtype"]) == ("cpu", "float32")


@needs_cpu_torch
@pytest.mark.parametrize("command", ["encoder", "decoder", "up"])
def test_device_cuda_on_a_cpu_torch_is_one_line_and_exit_2(tmp_path, tiny_model_dir, command):
    extra = ["--encoder", "127.0.0.1:1"] if command == "decoder" else []
    result = run_cli(command, "--model", str(tiny_model_dir), "--device", "cuda", *extra, timeout=60)
    line = assert_usage_error(result, "--device cuda", "install a CUDA build of torch")
    assert result.stderr.strip() == line  # the whole of stderr: one line
