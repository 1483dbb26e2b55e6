"""`kubevirt-iommufd demo --scenario dra`: the DRA driver on a simulated node, with no cluster.

The real driver (`dra.driver.DraDriver`) runs in this process against the DRA kubelet stand-in
(registration and DRAPlugin v1 over gRPC on unix sockets) and the API server stand-in (the real
`kubernetes` client over HTTPS). The demo plays the scheduler: it allocates a claim on one of the
published devices by writing the claim's status, as kube-scheduler does. While the claim is
prepared its GPU is unbound from vfio-pci and bound again: the kubelet's health stream and the
device's taint in the slice follow, timed (`demo_health`). Each step prints what happened and
checks it.
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
from hostdev.config import PluginConfig, default_config
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks
from kubevirt_iommufd.demo_health import device_taints, slice_shows, stream_says, time_change
from kubevirt_iommufd.demo_scenarios import Scenario
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
    running_apiserver,
)
from sim.dra_kubelet import Claim, DRAKubeletStandIn, PrepareResult, SeenHealth
from sim.host import bind_driver, build_tree, unbind_driver

NODE = "gpu-node-1"
NAMESPACE = "vms"
CLAIM = "vm-gpu"
REQUEST = "gpu"
DEVICE_CLASS = "vfio-gpu"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
# Attributes shown per device in the slice summary (all of them are in the metadata file).
SHOWN = (PCI_BUS_ID, "productName", "numaNode", "iommuGroup", "iommufd")
# How long the health step waits for the stream and the slice, and how soon it wants them (the
# driver's aim is 100 ms on a quiet machine; the demo may share a busy one).
HEALTH_WAIT = 5.0
HEALTH_WITHIN = 1.0
Object = dict[str, Any]


def run_dra(scenario: Scenario, work: Path, checks: Checks) -> None:
    root = build_tree(scenario.node(), work / "node")
    inventory = scan_host(root)
    settings = build_settings(root, work)
    checks.step(1, "the DRA driver starts on a simulated node and registers with the kubelet")
    with running_cluster(settings, default_config()) as (api, kubelet, driver):
        if not check_registered(kubelet, driver, checks):
            return
        devices = _step_slices(api, checks)
        if not devices:
            return
        claim = _step_allocate(api, devices[0], checks)
        result = _step_prepare(kubelet, claim, devices[0], checks)
        if result is None:
            return
        files = _step_files(scenario, root, inventory, claim, devices[0], settings, checks)
        _step_health(api, kubelet, root, devices[0], files, checks)
        _step_unprepare(kubelet, claim, files, settings, checks)


def build_settings(root: Path, work: Path) -> DriverSettings:
    """The driver's settings for the simulated node at `root`, its directories under `work`."""
    return DriverSettings(
        node=NODE,
        driver=DEFAULT_DRIVER,
        root=root,
        kubelet_dir=work / "kubelet",
        cdi_dir=work / "cdi",
        state_dir=work / "state",
        run_dir=work / "run",
    )


@contextmanager
def running_cluster(
    settings: DriverSettings, config: PluginConfig
) -> Iterator[tuple[ApiServerStandIn, DRAKubeletStandIn, DraDriver]]:
    """The API server and kubelet stand-ins, and the real driver started against them."""
    with running_apiserver() as api, DRAKubeletStandIn(settings.kubelet_dir) as kubelet:
        api.put_node(NODE)
        with api.api_client() as client:
            driver = DraDriver(settings, config, PciIds.find(), ResourceApi(client))
            driver.start()
            try:
                yield api, kubelet, driver
            finally:
                driver.stop()


def check_registered(kubelet: DRAKubeletStandIn, driver: DraDriver, checks: Checks) -> bool:
    """Whether the driver registered with the kubelet as it should, shown."""
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
    if not api.wait_until(lambda: complete_pool(api.slices(NODE, DEFAULT_DRIVER)), 10):
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
        (d["name"], *(str(attribute_value(d["attributes"].get(key))) for key in SHOWN))
        for d in devices
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
    result = prepare_shown(kubelet, claim, checks)
    if result is None:
        return None
    checks.check(
        [(d.request_names, d.pool_name, d.device_name) for d in result.devices]
        == [((REQUEST,), NODE, device["name"])],
        f"the answer names request {REQUEST}'s device and two CDI devices (nodes, metadata)",
    )
    again = kubelet.node_prepare_resources([claim]).get(claim.uid)
    checks.check(again == result, "asked again (as the kubelet retries), the same answer")
    return result


def prepare_shown(kubelet: DRAKubeletStandIn, claim: Claim, checks: Checks) -> PrepareResult | None:
    """The kubelet's NodePrepareResources of `claim`, checked and shown; None when it failed."""
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
    checks.show(pretty_json(spec))
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
    checks.show(pretty_json(metadata))
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


def _step_health(
    api: ApiServerStandIn,
    kubelet: DRAKubeletStandIn,
    root: Path,
    device: Object,
    files: list[Path],
    checks: Checks,
) -> None:
    checks.step(6, "the VM's GPU loses vfio-pci and gets it back: the health stream and the slice")
    name, bdf = device["name"], str(_bdf(device))
    key = f"{NODE}/{name}"
    try:
        kubelet.wait_health(DEFAULT_DRIVER, lambda h: _all_healthy(h, 8), HEALTH_WAIT)
    except TimeoutError:
        checks.check(False, f"the kubelet's health stream says 8 devices Healthy ({HEALTH_WAIT} s)")
        return
    checks.show(f"NodeWatchResources (gRPC): 8 devices Healthy; unbind {bdf} from vfio-pci")
    down = time_change(
        lambda: unbind_driver(root, bdf),
        [
            stream_says(kubelet, DEFAULT_DRIVER, key, "Unhealthy"),
            slice_shows(api, NODE, DEFAULT_DRIVER, name, tainted=True),
        ],
        HEALTH_WAIT,
    )
    seen = kubelet.health(DEFAULT_DRIVER).get(key)
    checks.show(f"health stream: {key} {seen.health if seen else '-'} after {_ms(down[0])}")
    checks.show(f"  {seen.message if seen else ''}")
    taints = device_taints(api.slices(NODE, DEFAULT_DRIVER), DEFAULT_DRIVER, name) or []
    checks.show(f"slice: {name} taints {json.dumps(taints)} after {_ms(down[1])}")
    allocatable = _gpus(api.allocatable(NODE, DEFAULT_DRIVER))
    checks.check(
        _within(down[0]) and seen is not None and bool(seen.message),
        f"the kubelet reads it Unhealthy, and why, within {_ms(HEALTH_WITHIN)}",
    )
    checks.check(
        _within(down[1]) and name not in allocatable and len(allocatable) == 7,
        f"its slice entry is tainted NoSchedule within {_ms(HEALTH_WITHIN)}: the scheduler"
        f" allocates the 7 others ({len(allocatable)} allocatable)",
    )
    checks.check(
        bool(files) and all(p.exists() for p in files),
        "the claim stays prepared, its CDI spec and metadata in place: the VM decides",
    )
    checks.show(f"bind {bdf} to vfio-pci again")
    up = time_change(
        lambda: bind_driver(root, bdf, "vfio-pci"),
        [
            stream_says(kubelet, DEFAULT_DRIVER, key, "Healthy"),
            slice_shows(api, NODE, DEFAULT_DRIVER, name, tainted=False),
        ],
        HEALTH_WAIT,
    )
    checks.show(f"health stream: {key} Healthy after {_ms(up[0])}")
    checks.show(f"slice: {name} untainted after {_ms(up[1])}")
    allocatable = _gpus(api.allocatable(NODE, DEFAULT_DRIVER))
    checks.check(
        _within(up[0]) and _all_healthy(kubelet.health(DEFAULT_DRIVER), 8),
        f"the kubelet reads it Healthy again within {_ms(HEALTH_WITHIN)}",
    )
    checks.check(
        _within(up[1]) and len(allocatable) == 8,
        f"the taint is gone within {_ms(HEALTH_WITHIN)}: all 8 allocatable again",
    )


def _gpus(devices: list[str]) -> list[str]:
    """The PCI devices among `devices`, without the iommufd slots published after them."""
    return [d for d in devices if slot_index(d) is None]


def _all_healthy(health: dict[str, SeenHealth], count: int) -> bool:
    return len(health) == count and all(h.health == "Healthy" for h in health.values())


def _within(seconds: float | None) -> bool:
    return seconds is not None and seconds <= HEALTH_WITHIN


def _ms(seconds: float | None) -> str:
    return "(not seen)" if seconds is None else f"{seconds * 1000:.0f} ms"


def _step_unprepare(
    kubelet: DRAKubeletStandIn,
    claim: Claim,
    files: list[Path],
    settings: DriverSettings,
    checks: Checks,
) -> None:
    checks.step(7, "the VM's pod is gone: NodeUnprepareResources (gRPC)")
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


def pretty_json(value: object, indent: str = "") -> str:
    """JSON indented by level, with each object or list that fits on a short line kept on one."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(indent) + len(flat) <= 72 or not isinstance(value, dict | list) or not value:
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {pretty_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    items = [f"{inner}{pretty_json(v, inner)}" for v in value]
    return "[\n" + ",\n".join(items) + f"\n{indent}]"


def complete_pool(slices: list[Object]) -> bool:
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
    text = attribute_value(device.get("attributes", {}).get(PCI_BUS_ID))
    try:
        return Bdf.parse(str(text))
    except ValueError:
        return None


def attribute_value(typed: object) -> object:
    """An attribute's value, whatever its type (`{"string": …}`, `{"int": …}`, `{"bool": …}`)."""
    return next(iter(typed.values()), "-") if isinstance(typed, dict) else "-"
