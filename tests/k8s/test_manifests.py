"""The Kubernetes manifests: every overlay renders with `kubectl kustomize`, validates against the
Kubernetes 1.30+ schemas offline (kubernetes-validate), and says what the services expect: gRPC probes
on the ports the services listen on, flags the CLI accepts, a shared process namespace and a memory
/dev/shm for the node-local pair, GPUs for the GPU overlays, drains that fit the grace period."""

from __future__ import annotations

import os

import pytest

from decoder_svc.encoders.discovery import parse_dns_target
from decoder_svc.main import build_arg_parser as decoder_parser
from encoder_svc.main import build_arg_parser as encoder_parser
from tests.k8s.render import (
    K8S,
    KUBECTL,
    OVERLAYS,
    Rendered,
    container,
    environment,
    expanded_args,
    flag,
    pod_spec,
    render,
    sleep_seconds,
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: it renders the "
                                "Kustomize overlays (kubectl kustomize); install kubectl to run these")

kubernetes_validate = pytest.importorskip("kubernetes_validate")

# Kubernetes versions whose schemas every object must satisfy (strict: unknown fields are errors).
VERSIONS = ["1.30.0", "1.32.0", "1.34.0", kubernetes_validate.latest_version() + ".0"]
# pair-gpu shares one GPU through Dynamic Resource Allocation, whose v1 API (ResourceClaimTemplate,
# PodSpec.resourceClaims[].resourceClaimTemplateName) exists from Kubernetes 1.34 on.
MIN_VERSION = {"pair-gpu": (1, 34)}
GPU_OVERLAYS = {"pair-gpu", "pair-gpu-single", "pools-gpu", "pools-gpu-tp2", "pools-gpu-nixl"}
# Pools whose decoders READ embeddings from the encoders over NIXL (components/nixl), on an image built with
# the nixl extra (mmserve:cpu-nixl, mmserve:gpu-nixl).
NIXL_OVERLAYS = {"pools-cpu-nixl", "pools-gpu-nixl"}
SERVICES = {"encoder": encoder_parser, "decoder": decoder_parser}
GRPC_GRACE_S = 5  # GrpcService.wait: in-flight RPCs get this long after the drain and shutdown


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> Rendered:
    return Rendered(request.param, render(K8S / "overlays" / request.param))


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def deployments(r: Rendered) -> list[dict]:
    found = r.of_kind("Deployment")
    assert found, f"{r.name} renders no Deployment"
    return found


def mmserve_containers(r: Rendered):
    """(deployment, container, service name) for each encoder or decoder container."""
    for d in deployments(r):
        for c in pod_spec(d)["containers"]:
            args = expanded_args(r, c)
            known = (*SERVICES, "gateway")
            assert c["command"] == ["mmserve"] and args[0] in known, (r.name, c["name"], args)
            if args[0] != "gateway":  # the gateway's checks: test_gateway.py
                yield d, c, args[0]


def is_gateway(d: dict) -> bool:
    return pod_labels(d)["app.kubernetes.io/component"] == "gateway"


def test_every_overlay_is_found():
    known = {"pair-cpu", "pair-gpu", "pools-cpu", "pools-gpu", "pools-gpu-tp2", *NIXL_OVERLAYS}
    assert known <= set(OVERLAYS)


def image_of(name: str) -> str:
    """The image an overlay's mmserve containers run."""
    image = "mmserve:gpu" if name in GPU_OVERLAYS else "mmserve:cpu"
    return image + "-nixl" if name in NIXL_OVERLAYS else image


def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    checked = 0
    for obj in overlay.objects:
        for version in VERSIONS:
            if tuple(int(x) for x in version.split(".")[:2]) < MIN_VERSION.get(overlay.name, (1, 30)):
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay.name}: {obj['kind']}/{obj['metadata']['name']} on {version}: {exc}")
            checked += 1
    assert checked >= len(overlay.objects) * 2


def test_probes_are_grpc_on_the_port_each_service_listens_on(overlay):
    for _, c, service in mmserve_containers(overlay):
        args = expanded_args(overlay, c)
        port = int(flag(args, "--port"))
        assert port == {"encoder": 50051, "decoder": 50052}[service]
        assert port in [p["containerPort"] for p in c["ports"]]
        assert flag(args, "--host") == "0.0.0.0"  # the kubelet probes the Pod IP
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (overlay.name, c["name"], probe)
        # Liveness must not kill a container that is draining (NOT_SERVING for up to --drain-timeout).
        live = c["livenessProbe"]
        drain = float(flag(args, "--drain-timeout") or 0)
        assert live["periodSeconds"] * live["failureThreshold"] > drain


def test_flags_images_and_ports_match_the_cli(overlay, tiny_model_dir):
    config = overlay.config()
    assert config["MMSERVE_MODEL_DIR"].startswith("/models/")
    for d, c, service in mmserve_containers(overlay):
        args = expanded_args(overlay, c)
        assert "$(" not in " ".join(args), f"unexpanded variable in {args}"
        assert flag(args, "--model") == environment(overlay, c)["MMSERVE_MODEL_DIR"]
        # The service's own parser accepts every flag and value (--model pointed at a real checkpoint).
        args[args.index("--model") + 1] = str(tiny_model_dir)
        parsed = SERVICES[service]().parse_args(args[1:])
        assert parsed.device == ("cuda" if overlay.name in GPU_OVERLAYS else "cpu")
        if service == "decoder":
            for spec in parsed.encoder:
                parse_dns_target(spec)  # the check main() makes
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert parsed.metrics_port in named.values()
        assert c["image"] == image_of(overlay.name)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/models"] == "models"
        assert {"/etc/mmserve/tls", "/etc/mmserve/auth"} <= set(mounts)  # the Secrets' places
        assert d["spec"]["selector"]["matchLabels"].items() <= pod_labels(d).items()


def test_services_point_at_named_container_ports(overlay):
    for svc in overlay.of_kind("Service"):
        selector = svc["spec"]["selector"]
        pods = [d for d in deployments(overlay) if selector.items() <= pod_labels(d).items()]
        assert pods, f"Service {svc['metadata']['name']} selects no Pod"
        names = {p["name"]: p["containerPort"]
                 for d in pods for c in pod_spec(d)["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert names[port["targetPort"]] == port["port"], (svc["metadata"]["name"], port)


def test_grace_period_covers_prestop_and_drain(overlay):
    for d in deployments(overlay):
        grace = pod_spec(d)["terminationGracePeriodSeconds"]
        for c in pod_spec(d)["containers"]:
            args = expanded_args(overlay, c)
            drain = float(flag(args, "--drain-timeout") or 0)
            assert sleep_seconds(c) + drain + GRPC_GRACE_S < grace, (overlay.name, c["name"])
            if args[0] == "decoder":
                assert drain == 30


def test_each_deployment_has_a_disruption_budget(overlay):
    budgets = overlay.of_kind("PodDisruptionBudget")
    for d in deployments(overlay):
        labels = pod_labels(d).items()
        assert [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels], d["metadata"]


def test_network_policies_admit_only_decoders_to_encoders_and_clients_to_decoders(overlay):
    policies = overlay.of_kind("NetworkPolicy")
    for d in deployments(overlay):
        labels = pod_labels(d)
        if is_gateway(d):
            continue  # HTTP from clients' namespaces: test_gateway.py
        (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        rules = {port["port"]: rule["from"] for rule in policy["spec"]["ingress"] for port in rule["ports"]}
        grpc_ports = {p["containerPort"] for c in pod_spec(d)["containers"] for p in c["ports"]
                      if p["name"].endswith("grpc")}
        if labels["app.kubernetes.io/component"] == "encoder":
            decoders = {"app.kubernetes.io/name": "mmserve", "app.kubernetes.io/component": "decoder"}
            assert rules[50051] == [{"podSelector": {"matchLabels": decoders}}]
        else:  # a decoder, alone or in a pair: clients' namespaces and the gateway only
            assert 50052 in rules and {"namespaceSelector": {"matchLabels": {"mmserve.io/client": "true"}}} \
                in rules[50052]
            assert all(set(peer) <= {"namespaceSelector", "podSelector"} for peer in rules[50052])
            if labels["app.kubernetes.io/component"] == "pair":
                assert 50051 in grpc_ports and 50051 not in rules  # the pair's encoder: localhost only


def test_the_node_local_pair_shares_processes_shm_and_one_gpu(overlay):
    if not overlay.name.startswith("pair"):
        pytest.skip("pools overlay")
    (pair,) = [d for d in deployments(overlay) if not is_gateway(d)]
    spec = pod_spec(pair)
    assert spec["shareProcessNamespace"] is True
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    for name in ("encoder", "decoder"):
        mounts = {m["mountPath"]: m["name"] for m in container(pair, name)["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"
    decoder_args = expanded_args(overlay, container(pair, "decoder"))
    assert flag(decoder_args, "--encoder") == "127.0.0.1:50051"  # the encoder beside it
    encoder, decoder = container(pair, "encoder"), container(pair, "decoder")
    if overlay.name == "pair-gpu":  # one DRA claim, listed by both containers: the same GPU
        assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "mmserve-gpu"}]
        assert encoder["resources"]["claims"] == decoder["resources"]["claims"] == [{"name": "gpu"}]
        overlay.get("ResourceClaimTemplate", "mmserve-gpu")
    if overlay.name == "pair-gpu-single":
        assert decoder["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert environment(overlay, encoder)["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.count": "1"}


def test_pools_find_encoders_through_the_headless_service(overlay):
    if not overlay.name.startswith("pools"):
        pytest.skip("pair overlay")
    decoder = overlay.get("Deployment", "mmserve-decoder")
    target = parse_dns_target(flag(expanded_args(overlay, container(decoder, "decoder")), "--encoder"))
    service = overlay.get("Service", target.host)
    assert service["spec"]["clusterIP"] == "None"  # one DNS record per ready encoder Pod
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert target.port in [p["port"] for p in service["spec"]["ports"]]
    encoder = overlay.get("Deployment", "mmserve-encoder")
    assert service["spec"]["selector"].items() <= pod_labels(encoder).items()
    # The encoder stays up past the decoders' re-resolve interval after it leaves DNS.
    decoder_args = expanded_args(overlay, container(decoder, "decoder"))
    interval = float(flag(decoder_args, "--encoder-resolve-interval"))
    assert sleep_seconds(container(encoder, "encoder")) > interval


def test_gpu_overlays_ask_for_gpus_and_cpu_overlays_make_the_tiny_model(overlay):
    specs = [pod_spec(d) for d in deployments(overlay)]
    if overlay.name in GPU_OVERLAYS:
        overlay.get("PersistentVolumeClaim", "mmserve-models")
        assert overlay.config()["MMSERVE_DTYPE"] == "bfloat16"
        for d in [d for d in deployments(overlay) if not is_gateway(d)]:  # the gateway needs no GPU
            gpus = [c for c in pod_spec(d)["containers"]
                    if c["resources"].get("limits", {}).get("nvidia.com/gpu") or c["resources"].get("claims")]
            assert gpus, f"{overlay.name}: {d['metadata']['name']} asks for no GPU"
        if overlay.name.startswith("pools-gpu"):
            for d in [d for d in deployments(overlay) if not is_gateway(d)]:
                (c,) = pod_spec(d)["containers"]
                resources = c["resources"]
                # One GPU per Pod, except the tensor-parallel decoder: one per rank.
                gpus = str(int(flag(expanded_args(overlay, c), "--tensor-parallel-size") or 1))
                assert resources["requests"]["nvidia.com/gpu"] == gpus
                assert resources["limits"]["nvidia.com/gpu"] == gpus
        for spec in specs:
            (models,) = [v for v in spec["volumes"] if v["name"] == "models"]
            assert models["persistentVolumeClaim"] == {"claimName": "mmserve-models", "readOnly": True}
    else:
        assert overlay.config()["MMSERVE_MODEL_DIR"] == "/models/tiny"
        for spec in specs:
            (init,) = spec["initContainers"]
            script = init["args"][0]
            assert "mmserve make-model --preset tiny" in script and 'mv "$tmp" "$MMSERVE_MODEL_DIR"' in script
            (models,) = [v for v in spec["volumes"] if v["name"] == "models"]
            assert set(models) == {"name", "emptyDir"}
            assert not overlay.of_kind("PersistentVolumeClaim")


def test_the_node_path_component_replaces_the_claim(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(K8S / 'overlays' / 'pools-gpu', tmp_path)}\n"
        f"components:\n  - {os.path.relpath(K8S / 'components' / 'models-hostpath', tmp_path)}\n")
    r = Rendered("pools-gpu+hostpath", render(tmp_path))
    assert not r.of_kind("PersistentVolumeClaim")
    for d in deployments(r):
        (models,) = [v for v in pod_spec(d)["volumes"] if v["name"] == "models"]
        assert set(models) == {"name", "hostPath"} and models["hostPath"]["path"] == "/var/lib/mmserve/models"
    for obj in r.objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_the_tensor_parallel_decoder_has_a_gpu_per_rank_and_shared_memory(tiny_model_dir):
    r = Rendered("pools-gpu-tp2", render(K8S / "overlays" / "pools-gpu-tp2"))
    decoder = container(r.get("Deployment", "mmserve-decoder"), "decoder")
    args = expanded_args(r, decoder)
    args[args.index("--model") + 1] = str(tiny_model_dir)
    assert decoder_parser().parse_args(args[1:]).tensor_parallel_size == 2
    assert decoder["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # NCCL's segments: a memory-backed /dev/shm, not the container's 64 MiB.
    spec = pod_spec(r.get("Deployment", "mmserve-decoder"))
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"]: m["name"] for m in decoder["volumeMounts"]}["/dev/shm"] == "dshm"
    encoder = container(r.get("Deployment", "mmserve-encoder"), "encoder")
    assert "--tensor-parallel-size" not in expanded_args(r, encoder)
    assert encoder["resources"]["limits"]["nvidia.com/gpu"] == "1"


def _port_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split("-"))
    return low, high


def test_nixl_only_where_an_overlay_asks_for_it(overlay, tiny_model_dir):
    """Encoders offer NIXL (with a private arena) exactly in the NIXL overlays; elsewhere nothing changed."""
    for _, c, service in mmserve_containers(overlay):
        args = expanded_args(overlay, c)
        args[args.index("--model") + 1] = str(tiny_model_dir)
        parsed = SERVICES[service]().parse_args(args[1:])
        if service == "encoder":
            assert parsed.nixl is (overlay.name in NIXL_OVERLAYS), (overlay.name, args)
            assert parsed.arena == ("private" if overlay.name in NIXL_OVERLAYS else "auto")
    if overlay.name not in NIXL_OVERLAYS:
        assert not [k for k in overlay.config() if k.startswith("UCX_")]


@pytest.fixture(scope="module", params=sorted(NIXL_OVERLAYS))
def nixl_overlay(request) -> Rendered:
    return Rendered(request.param, render(K8S / "overlays" / request.param))


def test_nixl_pools_read_across_pods_over_ucx(nixl_overlay, tiny_model_dir):
    r = nixl_overlay
    encoder_d, decoder_d = r.get("Deployment", "mmserve-encoder"), r.get("Deployment", "mmserve-decoder")
    encoder, decoder = container(encoder_d, "encoder"), container(decoder_d, "decoder")
    args = expanded_args(r, encoder)
    args[args.index("--model") + 1] = str(tiny_model_dir)
    parsed = encoder_parser().parse_args(args[1:])
    assert parsed.nixl is True and parsed.arena == "private"
    for d in (encoder_d, decoder_d, r.get("Deployment", "mmserve-gateway")):
        for c in [*pod_spec(d)["containers"], *pod_spec(d).get("initContainers", [])]:
            assert c["image"] == image_of(r.name), (r.name, c["name"])  # one image, with the nixl extra
    # Separate Pods, as on separate hosts: no node namespaces, no shared process namespace.
    for d in (encoder_d, decoder_d):
        spec = pod_spec(d)
        for key in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
            assert not spec.get(key), (r.name, d["metadata"]["name"], key)
    # UCX: what the docs say, read by both services (mmserve-config).
    for c in (encoder, decoder):
        env = environment(r, c)
        assert env["UCX_TLS"] == ("tcp,cuda_copy" if r.name in GPU_OVERLAYS else "tcp")
        low, high = _port_range(env["UCX_TCP_PORT_RANGE"])
        assert 1024 < low < high < 32768  # below Linux's ephemeral ports: no clash with outgoing ones
    # The encoders' NetworkPolicy opens exactly that range, to decoder Pods only.
    (policy,) = [p for p in r.of_kind("NetworkPolicy") if p["metadata"]["name"] == "mmserve-encoder"]
    decoders = {"app.kubernetes.io/name": "mmserve", "app.kubernetes.io/component": "decoder"}
    ucx = [rule for rule in policy["spec"]["ingress"] for port in rule["ports"] if port.get("endPort")]
    assert len(ucx) == 1
    (port,) = ucx[0]["ports"]
    assert (port["port"], port["endPort"]) == _port_range(environment(r, encoder)["UCX_TCP_PORT_RANGE"])
    assert port["protocol"] == "TCP" and ucx[0]["from"] == [{"podSelector": {"matchLabels": decoders}}]
    # Encoders keep away from decoder nodes where they can.
    anti = pod_spec(encoder_d)["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == decoders
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    if r.name in GPU_OVERLAYS:  # encoder pools on nodes of their own
        assert pod_spec(encoder_d)["nodeSelector"] == {"mmserve.io/pool": "encoder"}
        assert pod_spec(decoder_d)["nodeSelector"] == {"mmserve.io/pool": "decoder"}
