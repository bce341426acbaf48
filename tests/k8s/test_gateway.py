"""The gateway and the autoscalers in every overlay: an OpenAI endpoint in each topology, reaching the
decoders through their Service by DNS, probed on /health; HPAs (autoscaling/v2) on metrics the
services export."""

from __future__ import annotations

import pytest

from gateway.main import build_arg_parser as gateway_parser
from tests.k8s.render import (
    K8S,
    KUBECTL,
    OVERLAYS,
    Rendered,
    container,
    expanded_args,
    pod_spec,
    render,
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: it renders the overlays")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> Rendered:
    return Rendered(request.param, render(K8S / "overlays" / request.param))


def test_every_overlay_has_a_gateway_reaching_the_decoders_by_dns(overlay, tiny_model_dir):
    gateway = overlay.get("Deployment", "mmserve-gateway")
    c = container(gateway, "gateway")
    args = expanded_args(overlay, c)
    assert args[0] == "gateway" and "$(" not in " ".join(args)
    args[args.index("--model") + 1] = str(tiny_model_dir)
    parsed = gateway_parser().parse_args(args[1:])
    assert parsed.host == "0.0.0.0" and parsed.port == 8000 and parsed.served_model_name
    (decoder,) = parsed.decoder
    host, port = decoder.split(":")
    service = overlay.get("Service", host)  # a Service name: cluster DNS
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    decoders = [d for d in overlay.of_kind("Deployment")
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert decoders and all(d["metadata"]["name"] != "mmserve-gateway" for d in decoders)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in c["livenessProbe"]  # a decoder outage does not restart gateways
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]] == ["mmserve-gateway"]
    assert "nvidia.com/gpu" not in str(c["resources"])
    svc = overlay.get("Service", "mmserve-gateway")
    assert svc["spec"]["ports"][0]["port"] == 8000
    overlay.get("PodDisruptionBudget", "mmserve-gateway")
    policy = overlay.get("NetworkPolicy", "mmserve-gateway")
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8000]
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] > 30 + 5  # uvicorn's drain + preStop


def test_autoscalers_target_each_deployment_on_exported_metrics(overlay):
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in overlay.of_kind("HorizontalPodAutoscaler")}
    names = {d["metadata"]["name"] for d in overlay.of_kind("Deployment")}
    assert set(hpas) == names  # every Deployment: encoder and decoder pools, or the pair; the gateway
    exported = {"mmserve_encoder_queue_depth", "mmserve_decoder_waiting", "mmserve_decoder_running"}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        if name == "mmserve-gateway":
            assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        elif name == "mmserve-encoder":
            assert metrics == ["mmserve_encoder_queue_depth"]
        else:
            assert set(metrics) == {"mmserve_decoder_waiting", "mmserve_decoder_running"}
        assert set(metrics) <= exported


def test_adapter_rules_name_the_hpa_metrics():
    rules = (K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text()
    for needle in ("mmserve_encoder_queue_depth", "mmserve_decoder_(waiting|running)"):
        assert needle in rules
