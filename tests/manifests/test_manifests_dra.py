"""The DRA overlay: the driver's DaemonSet runs `kubevirt-iommufd dra` as its own parser reads it,
with the host paths the driver's sockets, CDI specs and metadata files need at the host's paths
and nothing more; RBAC is exactly what the driver calls; the DeviceClass selects the driver the
DaemonSet names; the KubeVirt patch turns on the DRA gates; and the overlay can be applied beside
a device-plugin overlay."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra.device_classes import build_device_class
from dra.kubelet_sockets import dra_socket_path, registration_socket_path, serialize_lock_path
from hostdev.binding.lock import LOCK_PATH
from hostdev.config import IOMMUFD_RESOURCE, parse_config
from k8s_schema_kit import assert_valid
from kubevirt_iommufd.cli import build_parser
from manifests_kit import MANIFESTS, NAMESPACE, by_kind, one, read_documents, render

NODE = "gpu-node-7"
POD_UID = "3f6c1b2a-9d4e-4c1b-8a7f-0e2d5c6b7a81"
STATE_ROOT = Path("/var/lib/kubevirt-iommufd")
RUN_ROOT = Path("/var/run/kubevirt-iommufd")


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one(render("dra"), "DaemonSet")["spec"]["template"]["spec"]
    return spec


def driver_container() -> dict[str, Any]:
    (container,) = pod_spec()["containers"]
    assert container["name"] == "dra"
    found: dict[str, Any] = container
    return found


def driver_args() -> argparse.Namespace:
    """The container's args as `kubevirt-iommufd` parses them, on a node named NODE, in the pod
    POD_UID (its environment as the downward API fills it)."""
    container = driver_container()
    args = [a.replace("$(NODE_NAME)", NODE) for a in container["args"]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POD_UID", POD_UID)
        return build_parser().parse_args(args)


def mounted_host_paths(container: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Host path of each of the container's hostPath mounts → (its path in the container, mount)."""
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    return {
        volumes[m["name"]]["hostPath"]["path"]: (m["mountPath"], m)
        for m in container["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }


def test_the_driver_runs_for_the_node_it_is_on() -> None:
    container = driver_container()
    args = driver_args()
    assert args.run.__module__ == "dra.command"
    assert "--node-name=$(NODE_NAME)" in container["args"]
    assert args.node_name == NODE
    assert container["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    assert args.instance_uid == POD_UID
    # The in-cluster service account, not a kubeconfig on the node.
    assert args.kubeconfig is None


def test_image_labels_and_scheduling_follow_the_device_plugin() -> None:
    plugin = one(render("self-signed"), "DaemonSet")
    driver = one(render("dra"), "DaemonSet")
    plugin_pod, driver_pod = plugin["spec"]["template"]["spec"], driver["spec"]["template"]["spec"]
    assert driver_pod["containers"][0]["image"] == plugin_pod["containers"][0]["image"]
    assert [c["image"] for c in driver_pod["initContainers"]] == [
        c["image"] for c in plugin_pod["initContainers"]
    ]
    assert driver["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kubevirt-iommufd"
    labels = driver["spec"]["template"]["metadata"]["labels"]
    assert driver["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert driver_pod["priorityClassName"] == "system-node-critical"
    assert driver_pod["tolerations"] == plugin_pod["tolerations"]
    # Its own node label: a node runs the device plugin, the driver, or both only by choice.
    assert driver_pod["nodeSelector"] == {"kubevirt-iommufd.io/dra": "true"}
    assert driver_pod["nodeSelector"] != plugin_pod["nodeSelector"]
    # No gap in an upgrade: the new pod runs beside the old, under socket names of its own.
    assert driver["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_the_driver_mounts_exactly_what_it_needs_at_the_hosts_paths() -> None:
    args = driver_args()
    container = driver_container()
    mounts = mounted_host_paths(container)
    kubelet = args.kubelet_dir
    assert set(mounts) == {
        "/sys",
        "/dev",
        str(kubelet / "plugins"),
        str(kubelet / "plugins_registry"),
        str(args.cdi_dir),
        str(STATE_ROOT),
        str(RUN_ROOT),
        "/",
        "/etc/kubernetes/node-feature-discovery/features.d",
    }
    # The kubelet dials the socket paths the driver reports, the runtime reads CDI specs from the
    # host, and bind-mounts metadata files from the host paths in the CDI spec: every path the
    # driver hands out must mean the same on the host.
    for host_path, (mount_path, _) in mounts.items():
        if host_path != "/":
            assert mount_path == host_path
    # The host's root, read-only, only for modprobe and modules.alias when binding on demand.
    assert mounts["/"][0] == str(args.host_root)
    assert mounts["/"][1]["readOnly"] is True
    assert mounts["/dev"][1]["readOnly"] is True
    assert mounts["/sys"][1].get("readOnly") is not True, "binding on demand writes sysfs"
    for path in (
        dra_socket_path(kubelet, args.driver_name, args.instance_uid),
        registration_socket_path(kubelet, args.driver_name, args.instance_uid),
        # Both pods of a rolling update lock the same file on the host.
        serialize_lock_path(kubelet, args.driver_name),
        args.state_dir / "claims",
        # Claims prepared by the release before the run directory have their files here.
        args.state_dir / "metadata",
        args.run_dir / "metadata",
        args.run_dir / "unprepared",
    ):
        assert any(path.is_relative_to(host_path) for host_path in mounts), path
    # The run directory is the host's tmpfs (/var/run is /run), apart from the state on disk.
    assert args.run_dir.is_relative_to(RUN_ROOT) and not args.run_dir.is_relative_to(STATE_ROOT)
    # Not the host's /proc: with the host's PID namespace the pod's /proc is the host's.
    assert "/proc" not in mounts
    # The node labels' feature file, where nfd-worker reads it (--feature-file's default).
    from hostdev.config import default_config
    from hostdev.labels.publisher import feature_file_path

    feature_file = feature_file_path(args.feature_file, default_config(), args.root, "dra")
    assert feature_file is not None
    assert mounts[str(feature_file.parent)][0] == str(feature_file.parent)
    assert pod_spec()["hostPID"] is True
    assert pod_spec()["hostNetwork"] is True, "kernel uevents reach only the host's netns"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is True


def test_the_config_the_driver_reads_is_the_shared_format() -> None:
    args = driver_args()
    container = driver_container()
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if args.config.is_relative_to(m["mountPath"])]
    assert mount["readOnly"] is True
    config_map_name = volumes[mount["name"]]["configMap"]["name"]
    config_map = next(
        c for c in by_kind(render("dra"), "ConfigMap") if c["metadata"]["name"] == config_map_name
    )
    text = config_map["data"][str(args.config.relative_to(mount["mountPath"]))]
    config = parse_config(yaml.safe_load(text) or {})
    assert config.resources, "the driver publishes the default resources"
    (reserve,) = pod_spec()["initContainers"]
    assert reserve["args"][0] == "bind"
    (from_config,) = [a for a in reserve["args"] if a.startswith("--from-config=")]
    reservations = Path(from_config.split("=", 1)[1])
    assert reservations.parent == args.config.parent
    assert reservations.name in config_map["data"]
    # The init container sees the host's root (for modprobe) read-only too.
    init_mounts = mounted_host_paths(reserve)
    assert init_mounts["/"][1]["readOnly"] is True


def test_every_binder_takes_the_hosts_binding_lock() -> None:
    # Both open the lock under the root `/` of their own container; it must be the host's file.
    lock = Path("/", LOCK_PATH)
    (reserve,) = pod_spec()["initContainers"]
    for container in (reserve, driver_container()):
        (host_dir,) = [
            host_path
            for host_path, (mount_path, _) in mounted_host_paths(container).items()
            if lock.is_relative_to(mount_path)
        ]
        assert host_dir == str(lock.parent), container["name"]


def probe_command(kind: str, socket_path: Path) -> list[str]:
    exec_command: list[str] = driver_container()[kind]["exec"]["command"]
    assert exec_command[0] == "python3"
    # The image's python3 is a Python; here the test's own stands in for it.
    return [sys.executable, *exec_command[1:-1], str(socket_path)]


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def test_the_probes_watch_the_registration_socket_of_their_own_pod() -> None:
    args = driver_args()
    container = driver_container()
    # An instance of a rolling update: it serves the registration socket once ready, not before.
    assert args.instance_uid == POD_UID
    socket_path = registration_socket_path(args.kubelet_dir, args.driver_name, POD_UID)
    # The full UID fits: the probe names the socket as the driver does, not a hashed fallback.
    assert POD_UID in socket_path.name
    for kind in PROBES:
        template = container[kind]["exec"]["command"][-1]
        assert template.format(uid=POD_UID) == str(socket_path)
    liveness = container["livenessProbe"]
    # A restarting kubelet removes the socket for a few seconds; that must not restart the driver.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60


def test_a_slow_start_is_waited_for_and_the_old_pod_stops_once_the_kubelet_calls_the_new() -> None:
    container = driver_container()
    startup = container["startupProbe"]
    # Liveness waits for the startup probe: a start under TCG took 80-150 s, plus up to 30 s
    # waiting for the other instance's lock.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert startup["periodSeconds"] <= 5, "ready soon after the registration is served"
    # The kubelet's plugin watcher registers a new socket within its 1 s reconcile: the old pod
    # is stopped only once the new one has been ready for longer than that.
    daemon_set = one(render("dra"), "DaemonSet")
    assert daemon_set["spec"]["minReadySeconds"] >= 2


@pytest.mark.parametrize("kind", PROBES)
def test_the_probe_passes_only_while_the_socket_takes_connections(kind: str) -> None:
    # A short directory: with the UID in it, a path under tmp_path is too long for a socket.
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        probe_the_socket(kind, Path(short) / "reg-{uid}.sock")


def probe_the_socket(kind: str, template: Path) -> None:
    path = Path(str(template).format(uid=POD_UID))

    def probe() -> int:
        return subprocess.run(
            probe_command(kind, template),
            capture_output=True,
            check=False,
            timeout=30,
            env={**os.environ, "POD_UID": POD_UID},
        ).returncode

    assert probe() != 0, "no socket"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    try:
        assert probe() == 0
    finally:
        listener.close()
    assert path.exists()
    assert probe() != 0, "a socket file nobody listens on"


def test_rbac_is_exactly_what_the_driver_calls() -> None:
    objects = render("dra")
    account = one(objects, "ServiceAccount")
    assert pod_spec()["serviceAccountName"] == account["metadata"]["name"]
    assert pod_spec().get("automountServiceAccountToken", True) is True
    assert account.get("automountServiceAccountToken", True) is True
    role = one(objects, "ClusterRole")
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": [
                "get",
                "list",
                "watch",
                "create",
                "update",
                "patch",
                "delete",
                "deletecollection",
            ],
        },
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    ]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")


def test_the_device_class_selects_the_driver_the_daemonset_names() -> None:
    driver = driver_args().driver_name
    (device_class,) = [
        c for c in by_kind(render("dra"), "DeviceClass") if "extendedResourceName" not in c["spec"]
    ]
    assert device_class["apiVersion"] == "resource.k8s.io/v1"
    assert device_class["metadata"]["name"] == driver
    assert device_class["spec"] == {
        "selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]
    }


def test_the_device_plugins_resource_names_are_served_as_extended_resources() -> None:
    """Every device type the KubeVirt patch permits for the device plugin, and the iommufd
    slots' resource, has a DeviceClass with that name as its extended resource, selecting the
    driver's devices of that resource as `dra-classes` builds it; valid from 1.34 (the generic
    check) to 1.36 and 1.37."""
    driver = driver_args().driver_name
    patch = yaml.safe_load((MANIFESTS / "kubevirt/kubevirt-patch.yaml").read_text())
    permitted = patch["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    classes = [
        c for c in by_kind(render("dra"), "DeviceClass") if "extendedResourceName" in c["spec"]
    ]
    # And the iommufd slots' class: the resource our webhook adds beside the devices.
    assert sorted(c["spec"]["extendedResourceName"] for c in classes) == sorted(
        [*(d["resourceName"] for d in permitted), IOMMUFD_RESOURCE]
    )
    for device_class in classes:
        metadata = device_class.pop("metadata")
        assert metadata["labels"] == {"app.kubernetes.io/part-of": "kubevirt-iommufd"}
        built = build_device_class(driver, device_class["spec"]["extendedResourceName"])
        assert metadata["name"] == built.pop("metadata")["name"]
        assert device_class == built
        for version in ("1.36", "1.37"):
            assert_valid({**device_class, "metadata": metadata}, version)


def test_the_example_claims_select_on_the_drivers_attributes() -> None:
    driver = driver_args().driver_name
    expressions = [
        selector["cel"]["expression"]
        for path in sorted((MANIFESTS / "examples").iterdir())
        for template in by_kind(read_documents(path), "ResourceClaimTemplate")
        for request in template["spec"]["spec"]["devices"]["requests"]
        for selector in request["exactly"].get("selectors", [])
    ]
    assert any(".productName ==" in e for e in expressions)
    for expression in expressions:
        assert f'device.attributes["{driver}"].' in expression


def test_the_kubevirt_patch_turns_on_the_dra_gates_only() -> None:
    patch = yaml.safe_load((MANIFESTS / "kubevirt/kubevirt-dra-patch.yaml").read_text())
    assert (patch["apiVersion"], patch["kind"]) == ("kubevirt.io/v1", "KubeVirt")
    assert patch["metadata"] == {"name": "kubevirt", "namespace": "kubevirt"}
    configuration = patch["spec"]["configuration"]
    # Claims need no permittedHostDevices; IOMMUFD would ask every launcher pod for the device
    # plugin's devices.kubevirt.io/iommufd, which a DRA-only node does not offer.
    assert configuration == {
        "developerConfiguration": {
            "featureGates": ["HostDevices", "HostDevicesWithDRA", "GPUsWithDRA"]
        }
    }


@pytest.mark.parametrize("other", ["self-signed", "cert-manager"])
def test_the_overlay_applies_beside_a_device_plugin_overlay(other: str) -> None:
    def key(obj: dict[str, Any]) -> tuple[str, str, str]:
        return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]

    theirs = {key(o): o for o in render(other)}
    shared = [(key(o), o) for o in render("dra") if key(o) in theirs]
    # The only object both create is the namespace, and both create it alike.
    assert [k for k, _ in shared] == [("Namespace", "", NAMESPACE)]
    for k, obj in shared:
        assert obj == theirs[k]
