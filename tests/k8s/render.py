"""Render the Kustomize overlays under deploy/k8s and look things up in the result."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBECTL = shutil.which("kubectl")


def render(path: Path) -> list[dict]:
    """The objects `kubectl kustomize path` renders."""
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@dataclass
class Rendered:
    """One overlay's objects."""

    name: str
    objects: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: {len(found)} {kind}/{name}"
        return found[0]

    def config(self) -> dict[str, str]:
        (cm,) = [o for o in self.of_kind("ConfigMap") if o["metadata"]["name"].startswith("mmserve-config")]
        return cm["data"]


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == name]
    return found


def environment(rendered: Rendered, c: dict) -> dict[str, str]:
    """The container's environment: its ConfigMaps (envFrom), then its own env."""
    env: dict[str, str] = {}
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in rendered.of_kind("ConfigMap")}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def expanded_args(rendered: Rendered, c: dict) -> list[str]:
    """command[1:] + args with $(VAR) expanded as the kubelet does."""
    env = environment(rendered, c)

    def expand(arg: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    return [expand(a) for a in [*c.get("command", [])[1:], *c.get("args", [])]]


def flag(args: list[str], name: str) -> str | None:
    """The value after `name` in args (the last one when repeated)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


def sleep_seconds(c: dict) -> int:
    """Seconds the container's preStop hook sleeps (0 without one)."""
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    match = re.search(r"sleep (\d+)", " ".join(command))
    return int(match.group(1)) if match else 0
