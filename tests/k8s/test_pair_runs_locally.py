"""The pair-cpu Pod's own commands, run here as its containers would run them: the init container's
script makes the tiny checkpoint (the same fingerprint as any other run of it), then the encoder and
decoder containers' expanded args start the two services, which serve a request with an image whose
embedding crosses through shared memory, as it does inside the Pod. Ports are moved to free ones and
/models to a temporary directory; nothing else is changed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from common.checkpoint import model_fingerprint
from common.client import DecoderClient
from common.health import wait_until_serving
from tests.integration.conftest import png
from tests.integration.harness import ROOT, free_port
from tests.k8s.render import K8S, KUBECTL, Rendered, container, environment, expanded_args, render
from tests.oracle import make_image

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: it renders the "
                                "Kustomize overlays (kubectl kustomize); install kubectl to run these")


def _mmserve_on_path(tmp_path) -> dict[str, str]:
    """An environment whose `mmserve` is this checkout's CLI (the init script calls it by name)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "mmserve"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m common.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": pythonpath}


def test_the_pair_pods_commands_make_the_model_and_serve(tmp_path, tiny_model_dir):
    r = Rendered("pair-cpu", render(K8S / "overlays" / "pair-cpu"))
    pair = r.get("Deployment", "mmserve-pair")
    spec = pair["spec"]["template"]["spec"]
    models = tmp_path / "models"
    models.mkdir()
    env = _mmserve_on_path(tmp_path)

    def local(value: str) -> str:
        return value.replace("/models", str(models), 1) if value.startswith("/models") else value

    # The init container, twice: the second run finds the checkpoint and leaves it alone.
    (init,) = spec["initContainers"]
    init_env = {**env, **{k: local(v) for k, v in environment(r, init).items()}}
    for _ in range(2):
        subprocess.run([*init["command"], *init["args"]], env=init_env, check=True, timeout=300,
                       capture_output=True)
    model_dir = models / "tiny"
    assert (model_dir / "config.json").exists() and not list(models.glob(".partial-*"))
    assert model_fingerprint(model_dir) == model_fingerprint(tiny_model_dir)  # deterministic preset

    ports = {"50051": str(free_port()), "50052": str(free_port()), "9101": str(free_port()),
             "9102": str(free_port())}

    def argv(name: str) -> list[str]:
        args = [local(a) for a in expanded_args(r, container(pair, name))]
        args = [ports.get(a, a) for a in args]
        return [a.replace(":50051", ":" + ports["50051"]) for a in args]

    procs = []
    try:
        for name, port in (("encoder", ports["50051"]), ("decoder", ports["50052"])):
            log = (tmp_path / f"{name}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "common.cli", *argv(name)], env=env,
                                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            alive = procs[-1]
            assert wait_until_serving(f"127.0.0.1:{port}", 180, is_alive=lambda p=alive: p.poll() is None), \
                (tmp_path / f"{name}.log").read_text()[-3000:]
        with DecoderClient(f"127.0.0.1:{ports['50052']}", timeout=120) as client:
            result = client.generate_text("USER: <image>\nWhat is in this picture? ASSISTANT:",
                                          [png(make_image(7))], max_tokens=3)
            assert result.usage.images == 1 and result.usage.completion_tokens == 3
            assert dict(client.stats().embedding_transports) == {"shm": 1}  # the Pod's /dev/shm path
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
