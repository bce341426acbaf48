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
from encoder_svc.main import build_arg_parser as encoder_parser

ROOT = Path(__file__).resolve().parents[2]
TP_FILES = ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.tp.yml"]
NIXL_FILES = ["docker-compose.yml", "docker-compose.nixl.yml"]


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


def _argv(command: list[str], env: dict[str, str], service: str = "decoder") -> list[str]:
    """The service's argv as `sh -c` runs its command ($$VAR is $VAR in the container)."""
    script = command[-1].replace("$$", "$")
    script = re.sub(r'"?\$(\w+)"?', lambda m: env.get(m.group(1), ""), script)
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "mmserve", service], argv
    return argv[3:]


_decoder_argv = _argv


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


def _merge(base, over):
    """Compose's merge of a later file into an earlier one, as far as these files need it: mappings merge
    key by key, volumes and ports add up, anything else (command, image, ipc) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if key in out and key in ("volumes", "ports") and isinstance(value, list):
                out[key] = [*out[key], *[v for v in value if v not in out[key]]]
            else:
                out[key] = _merge(out[key], value) if key in out else value
        return out
    return over


def _services(files: list[str]) -> dict:
    merged: dict = {}
    for name in files:
        merged = _merge(merged, _load(name))
    return merged["services"]


def _environment(service: dict, env: dict[str, str]) -> dict[str, str]:
    return {k: _interpolate(str(v), env) for k, v in service.get("environment", {}).items()}


def test_the_nixl_override_runs_the_services_as_on_two_hosts(tiny_model_dir):
    services = _services(NIXL_FILES)
    encoder, decoder = services["encoder"], services["decoder"]
    # No namespace shared with the host or with each other, no shared /dev/shm: nothing but the network.
    for service in (encoder, decoder):
        assert service["ipc"] == "private"
        assert "pid" not in service and "network_mode" not in service and "shm_size" not in service
        targets = [_interpolate(v, {}).split(":")[1] if isinstance(v, str) else v["target"]
                   for v in service.get("volumes", [])]
        assert "/dev/shm" not in targets and "/models" in targets
    assert _load("docker-compose.yml")["services"]["encoder"]["ipc"] == "host"  # the base file keeps its own
    # The encoder offers NIXL from a private arena; the user's own flags still arrive.
    for extra in ("", "--max-batch-images 8"):
        env = _environment(encoder, {"MMSERVE_ENCODER_ARGS": extra})
        env.update(MMSERVE_MODEL_DIR=str(tiny_model_dir), MMSERVE_DEVICE="cpu", MMSERVE_DTYPE="float32",
                   MMSERVE_CACHE_BYTES="1048576")
        argv = _argv(encoder["command"], env, "encoder")
        parsed = encoder_parser().parse_args(argv)
        assert parsed.nixl is True and parsed.arena == "private"
        if extra:
            assert parsed.max_batch_images == 8
    # The decoder needs no flag (it asks for NIXL when the package is installed): the base command, as the
    # docs say, pointed at the encoder's container.
    assert decoder["command"] == _load("docker-compose.yml")["services"]["decoder"]["command"]
    env = _environment(decoder, {})
    env.update(MMSERVE_MODEL_DIR=str(tiny_model_dir), MMSERVE_DEVICE="cpu", MMSERVE_DTYPE="float32")
    argv = _argv(decoder["command"], env)
    assert decoder_parser().parse_args(argv).encoder == ["encoder:50051"]
    # UCX on TCP over the Compose network, the same settings on both sides (docs/docker.md).
    for service in (encoder, decoder):
        env = _environment(service, {})
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "eth0"
        assert _environment(service, {"MMSERVE_UCX_TLS": "tcp,cuda_copy"})["UCX_TLS"] == "tcp,cuda_copy"


def test_the_nixl_override_builds_an_image_with_the_extra():
    services = _services(NIXL_FILES)
    build = services["model"]["build"]
    assert build["context"] == "."
    extras = _interpolate(build["args"]["EXTRAS"], {}).split(",")
    assert "nixl" in extras
    # What EXTRAS=nixl installs (pyproject.toml's [project.optional-dependencies]; no tomllib on 3.10).
    assert re.search(r'^nixl = \["nixl-cu12==', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    # Every service runs the image the model service builds, under a tag of its own.
    images = {name: _interpolate(s["image"], {}) for name, s in services.items()}
    assert set(images.values()) == {"mmserve:cpu-nixl"}, images
    # The default image is unchanged: no extra, its own tag.
    base = _load("docker-compose.yml")["services"]["model"]
    assert _interpolate(base["build"]["args"]["EXTRAS"], {}) == ""
    assert _interpolate(base["image"], {}) == "mmserve:cpu"


def test_docker_compose_renders_the_nixl_override():
    compose = _compose_v2()
    if compose is None:
        pytest.skip("the Docker Compose v2 plugin is not installed (`docker compose`)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSERVE_")}
    files = [arg for name in NIXL_FILES for arg in ("-f", name)]
    out = subprocess.run([*compose, *files, "config", "--format", "json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert services["model"]["build"]["args"]["EXTRAS"] == "nixl"
    for name in ("encoder", "decoder"):
        assert services[name]["ipc"] == "private" and "pid" not in services[name]
        assert services[name]["environment"]["UCX_TLS"] == "tcp"
    encoder_args = services["encoder"]["environment"]["MMSERVE_ENCODER_ARGS"]
    assert encoder_args.split() == ["--arena", "private", "--nixl"]
