"""The Compose files as configuration (no engine needed): the tensor-parallel override gives the decoder
its GPUs and --tensor-parallel-size through the base command, and the encoder a GPU of its own. Where the
Compose v2 plugin is installed, `docker compose config` renders the layered files too."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from decoder_svc.main import build_arg_parser as decoder_parser

ROOT = Path(__file__).resolve().parents[2]
TP_FILES = ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.tp.yml"]


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (!override, !reset) read as plain values."""


for _tag in ("!override", "!reset"):
    _ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)))


def _load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} with `env` (no nesting, as the files use it)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


def _decoder_argv(command: list[str], env: dict[str, str]) -> list[str]:
    """The decoder's argv as `sh -c` runs the service's command ($$VAR is $VAR in the container)."""
    script = command[-1].replace("$$", "$")
    script = re.sub(r'"?\$(\w+)"?', lambda m: env.get(m.group(1), ""), script)
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "mmserve", "decoder"], argv
    return argv[3:]


def _device_ids(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    return device["device_ids"]


def test_the_tp_override_gives_the_decoder_its_ranks_gpus(tiny_model_dir):
    base, tp = _load("docker-compose.yml"), _load("docker-compose.tp.yml")
    decoder, encoder = tp["services"]["decoder"], tp["services"]["encoder"]
    assert _interpolate(_device_ids(decoder)[0], {}) == "0,1"
    assert _interpolate(_device_ids(encoder)[0], {}) == "2"
    for tp_size, extra in (("", ""), ("4", "--max-num-seqs 16")):
        env = {"MMSERVE_TP": tp_size, "MMSERVE_DECODER_ARGS": extra}
        decoder_args = _interpolate(decoder["environment"]["MMSERVE_DECODER_ARGS"], env)
        argv = _decoder_argv(base["services"]["decoder"]["command"], {
            "MMSERVE_MODEL_DIR": str(tiny_model_dir), "MMSERVE_DEVICE": "cpu", "MMSERVE_DTYPE": "float32",
            "MMSERVE_DECODER_ARGS": decoder_args})
        parsed = decoder_parser().parse_args(argv)
        assert parsed.tensor_parallel_size == int(tp_size or 2)
        if extra:
            assert parsed.max_num_seqs == 16  # the user's own flags still arrive


def _compose_v2() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    ok = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0
    return [docker, "compose"] if ok else None


def test_docker_compose_renders_the_tp_override():
    compose = _compose_v2()
    if compose is None:
        pytest.skip("the Docker Compose v2 plugin is not installed (`docker compose`)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSERVE_")}
    env.update(MMSERVE_DECODER_GPUS="1,2", MMSERVE_ENCODER_GPU="0", MMSERVE_TP="2")
    files = [arg for name in TP_FILES for arg in ("-f", name)]
    out = subprocess.run([*compose, *files, "config", "--format", "json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    # !override replaced the GPU override's one-GPU list (Compose appends lists otherwise).
    assert _device_ids(services["decoder"]) == ["1,2"]
    assert _device_ids(services["encoder"]) == ["0"]
    decoder_args = services["decoder"]["environment"]["MMSERVE_DECODER_ARGS"]
    assert decoder_args.split() == ["--tensor-parallel-size", "2"]
    for name in ("encoder", "decoder"):  # CUDA IPC's needs, from docker-compose.gpu.yml
        assert services[name]["pid"] == "host" and services[name]["ipc"] == "host"
        assert services[name]["environment"]["MMSERVE_DEVICE"] == "cuda"
