"""Every overlay renders with kubectl kustomize, every object validates against the Kubernetes
schemas, and the parts that must agree across objects (names, ports, selectors, KubeVirt fields)
do."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hostdev.binding.lock import LOCK_PATH
from manifests_kit import (
    LATEST_K8S,
    MANIFESTS,
    NAMESPACE,
    REPO,
    by_kind,
    kubectl,
    one,
    read_documents,
    render,
)

OVERLAYS = sorted(p.name for p in (MANIFESTS / "overlays").iterdir() if p.is_dir())
# The overlays with the device plugin and the webhook; `dra` has the DRA driver alone.
WEBHOOK_OVERLAYS = [o for o in OVERLAYS if o != "dra"]
# The oldest Kubernetes each overlay must still install on: the DRA driver needs
# resource.k8s.io/v1, which Kubernetes 1.34 made GA.
OLDEST_K8S = {"dra": "1.34"}
OLDEST_K8S_DEFAULT = "1.33"
TLS_SECRET = "kubevirt-iommufd-webhook-tls"  # noqa: S105 - a Secret's name
# Kinds the Kubernetes schemas do not cover: checked field by field below.
CUSTOM_KINDS = {"Issuer", "Certificate", "KubeVirt", "VirtualMachineInstance"}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "DeviceClass",
}


def test_there_are_the_four_overlays() -> None:
    assert OVERLAYS == ["cert-manager", "dra", "self-signed", "self-signed-with-hook"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_kubernetes(overlay: str) -> None:
    objects = render(overlay)
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in (OLDEST_K8S.get(overlay, OLDEST_K8S_DEFAULT), LATEST_K8S):
            kubernetes_validate.validate(obj, version, strict=True)
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["metadata"]
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]


@pytest.mark.parametrize("overlay", WEBHOOK_OVERLAYS)
def test_the_parts_agree(overlay: str) -> None:
    objects = render(overlay)
    service = one(objects, "Service")
    deployment = next(d for d in by_kind(objects, "Deployment"))
    webhooks = one(objects, "MutatingWebhookConfiguration")["webhooks"]
    for hook in webhooks:
        client_service = hook["clientConfig"]["service"]
        assert client_service["name"] == service["metadata"]["name"]
        assert client_service["namespace"] == NAMESPACE
        assert client_service["port"] == service["spec"]["ports"][0]["port"]
        assert hook["sideEffects"] == "None"
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["timeoutSeconds"] <= 5
        assert hook["admissionReviewVersions"] == ["v1"]
    pods = next(h for h in webhooks if h["clientConfig"]["service"]["path"] == "/mutate-pod")
    assert pods["objectSelector"] == {"matchLabels": {"kubevirt.io": "virt-launcher"}}
    assert pods["failurePolicy"] == "Fail"
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["replicas"] == 2
    container = template["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {p["name"] for p in container["ports"]} == {"https", "health"}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == TLS_SECRET
    assert container["image"] == "ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0"


def test_plugin_daemonset_mounts_only_what_it_needs() -> None:
    daemonset = one(render("self-signed"), "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is False
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert set(host_paths.values()) == {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/dev",
        "/sys",
        "/var/run/kubevirt-iommufd",
        "/etc/kubernetes/node-feature-discovery/features.d",
        "/var/lib/kubevirt-iommufd",
        "/",
    }
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    # nfd-worker reads the feature file from the host path the plugin writes it to.
    assert mounts["nfd-features"]["mountPath"] == host_paths["nfd-features"]
    assert not mounts["nfd-features"].get("readOnly")
    assert mounts["dev"]["readOnly"] and mounts["pod-resources"]["readOnly"]
    # Only the init container that binds reserved devices sees the host's root, read-only.
    assert "host" not in mounts
    (reserve,) = spec["initContainers"]
    assert reserve["args"][0] == "bind"
    init_mounts = {m["name"]: m for m in reserve["volumeMounts"]}
    assert init_mounts["host"] == {"name": "host", "mountPath": "/host", "readOnly": True}
    assert spec["hostPID"] is True
    handoff = next(v for v in spec["volumes"] if v["name"] == "handoff")["hostPath"]["path"]
    # The kubelet mounts each hand-off socket into launchers from the host path, so the plugin
    # must see it at the same path.
    assert mounts["handoff"]["mountPath"] == handoff
    # Every writer of driver bindings takes the binding lock in the host's own directory, at the
    # host's path (hostdev.binding.lock.LOCK_PATH under the root /).
    for container in (reserve, spec["containers"][0]):
        (state,) = [m for m in container["volumeMounts"] if m["name"] == "state"]
        assert state == {"name": "state", "mountPath": "/var/lib/kubevirt-iommufd"}
    assert host_paths["state"] == "/" + str(Path(LOCK_PATH).parent)
    config = (
        yaml.safe_load(one(render("self-signed"), "ConfigMap")["data"]["plugin.yaml"])
        if False
        else None
    )
    assert config is None
    plugin_config = next(
        c for c in by_kind(render("self-signed"), "ConfigMap") if "plugin.yaml" in c["data"]
    )
    parsed = yaml.safe_load(plugin_config["data"]["plugin.yaml"])
    assert parsed["iommufd"]["socketDir"] == handoff
    assert parsed["nodeLabels"]["featuresDir"] == host_paths["nfd-features"]
    assert "--from-config=/etc/kubevirt-iommufd/reservations.yaml" in reserve["args"]
    assert "reservations.yaml" in plugin_config["data"]
    assert spec["containers"][0]["livenessProbe"]["httpGet"]["port"] == "metrics"


def test_plugin_and_webhook_configs_load() -> None:
    from hostdev.config import parse_config as parse_plugin_config
    from kubevirt_iommufd.reservations import parse_reservations
    from webhook.config import parse_config as parse_webhook_config

    for overlay in OVERLAYS:
        for config_map in by_kind(render(overlay), "ConfigMap"):
            data = config_map["data"]
            # The DRA driver reads the device plugin's format.
            for key in ("plugin.yaml", "dra.yaml"):
                if key in data:
                    parse_plugin_config(yaml.safe_load(data[key]) or {})
            if "reservations.yaml" in data:
                parse_reservations(yaml.safe_load(data["reservations.yaml"]))
            if "webhook.yaml" in data:
                config = parse_webhook_config(yaml.safe_load(data["webhook.yaml"]))
                if overlay == "self-signed-with-hook":
                    assert config.hook_sidecar is not None
                    assert "--cdev-check" in config.hook_sidecar.args


def test_cert_manager_objects() -> None:
    objects = render("cert-manager")
    certificate = one(objects, "Certificate")
    issuer = one(objects, "Issuer")
    assert certificate["apiVersion"] == issuer["apiVersion"] == "cert-manager.io/v1"
    assert certificate["spec"]["secretName"] == TLS_SECRET
    assert certificate["spec"]["issuerRef"] == {
        "kind": "Issuer",
        "name": issuer["metadata"]["name"],
    }
    assert "kubevirt-iommufd-webhook.kubevirt-iommufd.svc" in certificate["spec"]["dnsNames"]
    configuration = one(objects, "MutatingWebhookConfiguration")
    injected = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert injected == f"{NAMESPACE}/{certificate['metadata']['name']}"


def test_self_signed_job_has_exactly_the_rights_it_uses() -> None:
    objects = render("self-signed")
    job = one(objects, "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "certs"
    assert f"--secret={TLS_SECRET}" in args
    assert "--webhook-configuration=kubevirt-iommufd" in args
    role = one(objects, "Role")
    assert {"verbs": ["get", "update"], "resourceNames": [TLS_SECRET]}.items() <= next(
        r for r in role["rules"] if "resourceNames" in r
    ).items()
    cluster_role = one(objects, "ClusterRole")
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations"],
            "resourceNames": ["kubevirt-iommufd"],
            "verbs": ["get", "patch"],
        }
    ]
    cron = one(objects, "CronJob")
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"] == args


def test_kubevirt_patch_uses_the_fields_kubevirt_reads() -> None:
    patch = yaml.safe_load((MANIFESTS / "kubevirt/kubevirt-patch.yaml").read_text())
    assert (patch["apiVersion"], patch["kind"]) == ("kubevirt.io/v1", "KubeVirt")
    configuration = patch["spec"]["configuration"]
    assert set(configuration) == {"developerConfiguration", "permittedHostDevices"}
    gates = configuration["developerConfiguration"]["featureGates"]
    assert {"Sidecar", "HostDevices", "IOMMUFD"} <= set(gates)
    for device in configuration["permittedHostDevices"]["pciHostDevices"]:
        assert set(device) == {"pciVendorSelector", "resourceName", "externalResourceProvider"}
        vendor, product = device["pciVendorSelector"].split(":")
        assert len(vendor) == len(product) == 4
        int(vendor, 16), int(product, 16)
        assert device["externalResourceProvider"] is True
        assert device["resourceName"].startswith("nvidia.com/")


@pytest.mark.parametrize("example", sorted(p.name for p in (MANIFESTS / "examples").iterdir()))
def test_example_vmis(example: str) -> None:
    documents = read_documents(MANIFESTS / "examples" / example)
    vmi = one(documents, "VirtualMachineInstance")
    assert vmi["apiVersion"] == "kubevirt.io/v1"
    templates = {t["metadata"]["name"]: t for t in by_kind(documents, "ResourceClaimTemplate")}
    assert len(templates) == len(documents) - 1, "only the VMI and the claim templates it uses"
    for template in templates.values():
        kubernetes_validate.validate(template, LATEST_K8S, strict=True)
    claims = {c["name"]: c for c in vmi["spec"].get("resourceClaims", [])}
    assert {c["resourceClaimTemplateName"] for c in claims.values()} == set(templates)
    devices = vmi["spec"]["domain"]["devices"]
    named = devices.get("gpus", []) + devices.get("hostDevices", [])
    assert named
    for device in named:
        if "deviceName" in device:
            assert set(device) == {"name", "deviceName"}
            continue
        # KubeVirt's names (ClaimRequest, inlined in GPU and HostDevice): claimName is an entry
        # of spec.resourceClaims, requestName a request of that claim.
        assert set(device) == {"name", "claimName", "requestName"}
        template = templates[claims[device["claimName"]]["resourceClaimTemplateName"]]
        requests = {r["name"]: r for r in template["spec"]["spec"]["devices"]["requests"]}
        request = requests[device["requestName"]]["exactly"]
        classes = {c["metadata"]["name"] for c in by_kind(render("dra"), "DeviceClass")}
        assert request["deviceClassName"] in classes
        # KubeVirt takes exactly one device per request.
        assert request.get("count", 1) == 1
    # KubeVirt refuses a VMI whose gpus mix claims and device-plugin resources.
    assert len({"deviceName" in gpu for gpu in devices.get("gpus", [])}) <= 1
    annotations = vmi["metadata"].get("annotations", {})
    if "hooks.kubevirt.io/hookSidecars" in annotations:
        sidecars = json.loads(annotations["hooks.kubevirt.io/hookSidecars"])
        assert isinstance(sidecars, list) and sidecars[0]["args"][0] == "hook"
        assert annotations.get("iommufd.kubevirt.io/mode") in {None, "auto", "require", "disable"}


def test_there_are_examples_of_both_kinds_of_device() -> None:
    entries = [
        (kind, "claimName" in device)
        for path in (MANIFESTS / "examples").iterdir()
        for vmi in by_kind(read_documents(path), "VirtualMachineInstance")
        for kind in ("gpus", "hostDevices")
        for device in vmi["spec"]["domain"]["devices"].get(kind, [])
    ]
    assert set(entries) == {
        (kind, dra) for kind in ("gpus", "hostDevices") for dra in (True, False)
    }


@pytest.mark.parametrize("overlay", WEBHOOK_OVERLAYS)
def test_the_network_policy_admits_admissions_only_by_address(overlay: str) -> None:
    objects = render(overlay)
    policy = one(objects, "NetworkPolicy")["spec"]
    template = one(objects, "Deployment")["spec"]["template"]
    container = template["spec"]["containers"][0]

    assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    rules = {port["port"]: rule for rule in policy["ingress"] for port in rule["ports"]}
    # Every port the pod serves has a rule, or the probes would fail.
    assert set(rules) == {p["name"] for p in container["ports"]}
    admission = rules["https"]
    assert admission["from"], "an empty 'from' admits everyone"
    # The API server comes from host network: a pod or namespace selector would only admit pods.
    assert all(set(peer) == {"ipBlock"} for peer in admission["from"])
    assert "from" not in rules["health"]


def install_doc_overlay() -> dict[str, Any]:
    """The overlay docs/install.md gives for narrowing the policy, as a document."""
    text = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    section = text.split("### Network policy", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    document = yaml.safe_load(block)
    assert isinstance(document, dict)
    return document


def test_the_documented_patch_narrows_the_policy(tmp_path: Path) -> None:
    overlay = install_doc_overlay()
    # kustomize takes only relative paths to other kustomizations.
    overlay["resources"] = [os.path.relpath(MANIFESTS / "overlays" / "cert-manager", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))

    done = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    policy = one(objects, "NetworkPolicy")
    kubernetes_validate.validate(policy, LATEST_K8S, strict=True)
    assert policy["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.20.0.0/24"}}]
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": "https", "protocol": "TCP"}]


def test_the_label_node_component_grants_nodes_get_and_patch_only(tmp_path: Path) -> None:
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(MANIFESTS / "overlays" / "self-signed", tmp_path)],
        "components": [os.path.relpath(MANIFESTS / "components" / "label-node", tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    done = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    for obj in objects:
        if obj["kind"] not in CUSTOM_KINDS:
            for version in (OLDEST_K8S_DEFAULT, LATEST_K8S):
                kubernetes_validate.validate(obj, version, strict=True)
    spec = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    plugin = spec["containers"][0]
    assert "--label-node" in plugin["args"]
    assert plugin["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    ]
    assert spec["automountServiceAccountToken"] is True
    role = next(
        r
        for r in by_kind(objects, "ClusterRole")
        if r["metadata"]["name"] == "kubevirt-iommufd-plugin-node-labels"
    )
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    binding = next(
        b
        for b in by_kind(objects, "ClusterRoleBinding")
        if b["roleRef"]["name"] == "kubevirt-iommufd-plugin-node-labels"
    )
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": spec["serviceAccountName"],
            "namespace": NAMESPACE,
        }
    ]
    # Without the component the plugin keeps no token: labels go through NFD's feature file.
    base = one(render("self-signed"), "DaemonSet")["spec"]["template"]["spec"]
    assert base["automountServiceAccountToken"] is False
    assert "--label-node" not in base["containers"][0]["args"]
