"""`kubevirt-iommufd demo --scenario dra`: the DRA driver on a simulated node, with no cluster.

The real driver (`dra.driver.DraDriver`) runs in this process against the DRA kubelet stand-in
(registration and DRAPlugin v1 over gRPC on unix sockets) and the API server stand-in (the real
`kubernetes` client over HTTPS). The demo plays the scheduler: it allocates a claim on one of the
published devices by writing the claim's status, as kube-scheduler does. Each step prints what
happened and checks it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dra.api import ResourceApi
from dra.cdi import metadata_file_name
from dra.command import DEFAULT_DRIVER
from dra.driver import DraDriver, DriverSettings
from dra.iommufd_slots import slot_index
from hostdev.bdf import Bdf
from hostdev.config import default_config
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks
from kubevirt_iommufd.demo_scenarios import Scenario
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
    running_apiserver,
)
from sim.dra_kubelet import Claim, DRAKubeletStandIn, PrepareResult
from sim.host import build_tree

NODE = "gpu-node-1"
NAMESPACE = "vms"
CLAIM = "vm-gpu"
REQUEST = "gpu"
DEVICE_CLASS = "vfio-gpu"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
# Attributes shown per device in the slice summary (all of them are in the metadata file).
SHOWN = (PCI_BUS_ID, "productName", "numaNode", "iommuGroup", "iommufd")
Object = dict[str, Any]


def run_dra(scenario: Scenario, work: Path, checks: Checks) -> None:
    root = build_tree(scenario.node(), work / "node")
    inventory = scan_host(root)
    settings = DriverSettings(
        node=NODE,
        driver=DEFAULT_DRIVER,
        root=root,
        kubelet_dir=work / "kubelet",
        cdi_dir=work / "cdi",
        state_dir=work / "state",
    )
    checks.step(1, "the DRA driver starts on a simulated node and registers with the kubelet")
    with _cluster(settings) as (api, kubelet, driver):
        if not _step_register(kubelet, driver, checks):
            return
        devices = _step_slices(api, checks)
        if not devices:
            return
        claim = _step_allocate(api, devices[0], checks)
        result = _step_prepare(kubelet, claim, devices[0], checks)
        if result is None:
            return
        files = _step_files(scenario, root, inventory, claim, devices[0], settings, checks)
        _step_unprepare(kubelet, claim, files, settings, checks)


@contextmanager
def _cluster(
    settings: DriverSettings,
) -> Iterator[tuple[ApiServerStandIn, DRAKubeletStandIn, DraDriver]]:
    with running_apiserver() as api, DRAKubeletStandIn(settings.kubelet_dir) as kubelet:
        api.put_node(NODE)
        with api.api_client() as client:
            driver = DraDriver(settings, default_config(), PciIds.find(), ResourceApi(client))
            driver.start()
            try:
                yield api, kubelet, driver
            finally:
                driver.stop()


def _step_register(kubelet: DRAKubeletStandIn, driver: DraDriver, checks: Checks) -> bool:
    name = driver.settings.driver
    try:
        registration = kubelet.wait_registered(name)
    except TimeoutError:
        return checks.check(False, f"{name} registered with the kubelet within 5 s")
    checks.show(f"registration socket {registration.socket_path}")
    checks.show(
        f"GetInfo -> DRAPlugin {registration.driver}, versions"
        f" {', '.join(registration.supported_versions)}"
    )
    checks.show(f"            endpoint {registration.endpoint}")
    expected = driver.settings.kubelet_dir / "plugins" / name / "dra.sock"
    return checks.check(
        registration.service == "v1.DRAPlugin" and registration.endpoint == str(expected),
        f"registered: the kubelet speaks v1.DRAPlugin to {expected.name} in plugins/{name}/",
    )


def _step_slices(api: ApiServerStandIn, checks: Checks) -> list[Object]:
    checks.step(2, "it publishes the node's devices as ResourceSlices (resource.k8s.io/v1, HTTPS)")
    if not api.wait_until(lambda: _complete_pool(api.slices(NODE, DEFAULT_DRIVER)), 10):
        checks.check(False, "the pool's slices were published within 10 s")
        return []
    slices = api.slices(NODE, DEFAULT_DRIVER)
    pool = slices[0]["spec"]["pool"]
    entries = [d for s in slices for d in s["spec"]["devices"]]
    # The iommufd slots (dra.iommufd_slots) follow the GPUs; this demo prepares a GPU.
    devices = [d for d in entries if slot_index(d["name"]) is None]
    slots = [d["name"] for d in entries if slot_index(d["name"]) is not None]
    owners = {ref["uid"] for s in slices for ref in s["metadata"].get("ownerReferences", [])}
    node = api.read("Node", NODE) or {}
    checks.show(
        f"pool {pool['name']}, generation {pool['generation']}: {len(slices)} slice(s)"
        f" ({', '.join(s['metadata']['name'] for s in slices)}), {len(devices)} devices"
        f" and {len(slots)} iommufd slots ({slots[0] if slots else ''} …)"
    )
    rows = [("DEVICE", "PCI BUS ID", "PRODUCT", "NUMA", "GROUP", "IOMMUFD")]
    rows += [
        (d["name"], *(str(_value(d["attributes"].get(key))) for key in SHOWN)) for d in devices
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    checks.show(
        "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )
    )
    checks.check(
        len(devices) == 8 and pool["name"] == NODE and pool["resourceSliceCount"] == len(slices),
        f"8 GPUs in pool {NODE}, nodeName {NODE}, resourceSliceCount {len(slices)}",
    )
    checks.check(
        owners == {node.get("metadata", {}).get("uid")},
        f"the slices are owned by Node {NODE} (deleting the node deletes them)",
    )
    checks.check(
        all(_named_after_address(d) for d in devices),
        f"each device is named after its PCI address and carries {PCI_BUS_ID}",
    )
    return devices


def _step_allocate(api: ApiServerStandIn, device: Object, checks: Checks) -> Claim:
    checks.step(3, "the scheduler allocates a claim: 1 device of this driver from this node's pool")
    claim = api.put_claim(build_resource_claim(NAMESPACE, CLAIM, [REQUEST], DEVICE_CLASS))
    api.set_allocation(
        NAMESPACE,
        CLAIM,
        [AllocatedDevice(REQUEST, DEFAULT_DRIVER, NODE, device["name"])],
        node_name=NODE,
    )
    uid = claim["metadata"]["uid"]
    checks.show(f"ResourceClaim {NAMESPACE}/{CLAIM} (uid {uid}), request {REQUEST!r}")
    with api.api_client() as client:
        read = ResourceApi(client).read_claim(NAMESPACE, CLAIM)
    results = read["status"]["allocation"]["devices"]["results"]
    checks.show(
        "status.allocation.devices.results: "
        + ", ".join(f"{r['request']} -> {r['driver']} {r['pool']}/{r['device']}" for r in results)
    )
    checks.check(
        [(r["driver"], r["pool"], r["device"]) for r in results]
        == [(DEFAULT_DRIVER, NODE, device["name"])],
        f"the claim reads back allocated {device['name']} from pool {NODE}",
    )
    return Claim(NAMESPACE, uid, CLAIM)


def _step_prepare(
    kubelet: DRAKubeletStandIn, claim: Claim, device: Object, checks: Checks
) -> PrepareResult | None:
    checks.step(4, "the kubelet prepares the claim for the VM's pod: NodePrepareResources (gRPC)")
    result = kubelet.node_prepare_resources([claim]).get(claim.uid)
    if not checks.check(
        result is not None and not result.error, "the claim is prepared, with no error"
    ):
        checks.show(f"answer: {result}")
        return None
    assert result is not None
    for prepared in result.devices:
        checks.show(
            f"request {', '.join(prepared.request_names)}: {prepared.pool_name}/"
            f"{prepared.device_name}, CDI devices:"
        )
        for cdi in prepared.cdi_device_ids:
            checks.show(f"  {cdi}")
    checks.check(
        [(d.request_names, d.pool_name, d.device_name) for d in result.devices]
        == [((REQUEST,), NODE, device["name"])],
        f"the answer names request {REQUEST}'s device and two CDI devices (nodes, metadata)",
    )
    again = kubelet.node_prepare_resources([claim]).get(claim.uid)
    checks.check(again == result, "asked again (as the kubelet retries), the same answer")
    return result


def _step_files(
    scenario: Scenario,
    root: Path,
    inventory: HostInventory,
    claim: Claim,
    device: Object,
    settings: DriverSettings,
    checks: Checks,
) -> list[Path]:
    checks.step(5, "what the container runtime and KubeVirt read: the CDI spec and the metadata")
    spec_path = settings.cdi_dir / f"{settings.driver}-claim_{claim.uid}.json"
    if not checks.check(spec_path.is_file(), f"the claim's CDI spec is {spec_path.name}"):
        return []
    spec = json.loads(spec_path.read_text())
    checks.show(_pretty(spec))
    entries = {entry["name"]: entry["containerEdits"] for entry in spec["devices"]}
    nodes = [n["path"] for e in entries.values() for n in e.get("deviceNodes", [])]
    mounts = [m for e in entries.values() for m in e.get("mounts", [])]
    expected = _expected_nodes(scenario, inventory, _bdf(device))
    checks.check(
        nodes == expected and all((root / n.lstrip("/")).exists() for n in nodes),
        f"device nodes for {scenario.backend}: {' '.join(expected)} (all on the node)",
    )
    if not checks.check(len(mounts) == 1, "one mount: the request's metadata file, read-only"):
        return [spec_path]
    mount = mounts[0]
    host_path = Path(mount["hostPath"])
    metadata = json.loads(host_path.read_text())
    container_path = (
        f"{METADATA_ROOT}/resourceclaims/{CLAIM}/{REQUEST}/{metadata_file_name(settings.driver)}"
    )
    checks.show(f"metadata file, mounted in the pod at {mount['containerPath']}:")
    checks.show(_pretty(metadata))
    checks.check(
        mount["containerPath"] == container_path and "ro" in mount.get("options", []),
        f"mounted where KubeVirt reads it: …/resourceclaims/{CLAIM}/{REQUEST}/",
    )
    requests = metadata.get("requests", [])
    found = [(r["name"], d["name"], _bdf(d)) for r in requests for d in r.get("devices", [])]
    checks.check(
        metadata.get("kind") == "DeviceMetadata"
        and metadata.get("metadata", {}).get("uid") == claim.uid
        and found == [(REQUEST, device["name"], _bdf(device))],
        f"one request, one device, its PCI address {_bdf(device)}: what KubeVirt expects",
    )
    return [spec_path, host_path]


def _step_unprepare(
    kubelet: DRAKubeletStandIn,
    claim: Claim,
    files: list[Path],
    settings: DriverSettings,
    checks: Checks,
) -> None:
    checks.step(6, "the VM's pod is gone: NodeUnprepareResources (gRPC)")
    errors = kubelet.node_unprepare_resources([claim])
    checks.show(f"answer: {errors}")
    checks.check(errors == {claim.uid: ""}, "the claim is unprepared, with no error")
    record = settings.state_dir / "claims" / f"{claim.uid}.json"
    left = [str(p) for p in (*files, record) if p.exists()]
    checks.check(
        bool(files) and not left,
        "its CDI spec, metadata file and state record are gone"
        + (f" (left: {', '.join(left)})" if left else ""),
    )
    again = kubelet.node_unprepare_resources([claim])
    checks.check(again == {claim.uid: ""}, "asked again, it answers the same (idempotent)")


def _pretty(value: object, indent: str = "") -> str:
    """JSON indented by level, with each object or list that fits on a short line kept on one."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(indent) + len(flat) <= 72 or not isinstance(value, dict | list) or not value:
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    items = [f"{inner}{_pretty(v, inner)}" for v in value]
    return "[\n" + ",\n".join(items) + f"\n{indent}]"


def _complete_pool(slices: list[Object]) -> bool:
    """Whether every slice of the pool's newest generation is there, as the scheduler waits for."""
    if not slices:
        return False
    pools = [s["spec"]["pool"] for s in slices]
    newest = max(p["generation"] for p in pools)
    current = [p for p in pools if p["generation"] == newest]
    return bool(len(current) == len(pools) == current[0]["resourceSliceCount"])


def _expected_nodes(scenario: Scenario, inventory: HostInventory, bdf: Bdf | None) -> list[str]:
    function = inventory.function(bdf) if bdf else None
    group = inventory.group_of(function) if function else None
    if function is None or group is None:
        return ["(the allocated device is not on the node)"]
    legacy = ["/dev/vfio/vfio", group.legacy_node]
    if scenario.backend == "iommufd":
        return [function.cdev_path or "(no cdev)", "/dev/iommu", *legacy]
    return legacy


def _named_after_address(device: Object) -> bool:
    bdf = _bdf(device)
    return bdf is not None and device["name"] == "pci-" + str(bdf).replace(":", "-").replace(
        ".", "-"
    )


def _bdf(device: Object) -> Bdf | None:
    text = _value(device.get("attributes", {}).get(PCI_BUS_ID))
    try:
        return Bdf.parse(str(text))
    except ValueError:
        return None


def _value(typed: object) -> object:
    """An attribute's value, whatever its type (`{"string": …}`, `{"int": …}`, `{"bool": …}`)."""
    return next(iter(typed.values()), "-") if isinstance(typed, dict) else "-"
