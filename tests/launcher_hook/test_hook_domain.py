"""The rewrite on domain XML as KubeVirt writes it: golden outputs, each validated by libvirt."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from lxml import etree

from hook_kit import (
    GPU1,
    GPU2,
    LIBVIRT,
    NODES,
    VF,
    canonical,
    capabilities,
    libvirt_define_errors,
    load_domain_schema,
    read_data,
    schema_errors,
    uses_iommufd_xml,
    vmi_json,
)
from hostdev.bdf import Bdf
from launcher_hook.domain import DECISION_NS, rewrite_domain, undo_rewrite
from launcher_hook.errors import InvalidInput, IommufdRequired
from launcher_hook.model import (
    ANNOTATION_LIBVIRT_VERSION,
    ANNOTATION_MODE,
    Backend,
    Capabilities,
    DeviceSupport,
    LibvirtVersion,
    Policy,
    Sourced,
)

GOLDEN = Path(__file__).parent / "data/golden"
# Set to rewrite the golden files from the current code; review the diff before keeping it.
UPDATE = os.environ.get("KUBEVIRT_IOMMUFD_UPDATE_GOLDEN") == "1"
NS = {"d": DECISION_NS}


@pytest.fixture(scope="session")
def rng() -> etree.RelaxNG:
    """libvirt 12.9's schema, fetched once per session; a failure to fetch fails the tests."""
    return load_domain_schema()


@dataclass(frozen=True)
class Case:
    id: str
    fixture: str
    node: str
    libvirt: str
    policy: Policy = Policy.AUTO
    annotations: tuple[tuple[str, str], ...] = ()
    backends: tuple[str, ...] = ()
    """Expected backend of each PCI hostdev, in document order."""
    vmi: str = "vmi-h100.json"


CASES = [
    Case("gpus-libvirt-unknown", "kubevirt-gpus.xml", "cdevs", "unknown", backends=("legacy",) * 3),
    Case("gpus-libvirt-11.10", "kubevirt-gpus.xml", "cdevs", "11.10", backends=("legacy",) * 3),
    Case("gpus-libvirt-12.1", "kubevirt-gpus.xml", "cdevs", "12.1", backends=("iommufd",) * 3),
    Case("gpus-libvirt-12.2", "kubevirt-gpus.xml", "cdevs", "12.2", backends=("iommufd",) * 3),
    Case("gpus-libvirt-12.9", "kubevirt-gpus.xml", "cdevs", "12.9", backends=("iommufd",) * 3),
    Case(
        "gpus-no-cdev-node-12.1",
        "kubevirt-gpus.xml",
        "no-cdev-node",
        "12.1",
        backends=("iommufd", "legacy", "iommufd"),
    ),
    Case(
        "gpus-no-cdev-node-12.9",
        "kubevirt-gpus.xml",
        "no-cdev-node",
        "12.9",
        backends=("iommufd", "legacy", "iommufd"),
    ),
    Case(
        "gpus-legacy-kernel-12.9",
        "kubevirt-gpus.xml",
        "legacy-kernel",
        "12.9",
        backends=("legacy",) * 3,
    ),
    Case(
        "gpus-disabled-by-annotation",
        "kubevirt-gpus.xml",
        "cdevs",
        "12.9",
        annotations=((ANNOTATION_MODE, "disable"),),
        backends=("legacy",) * 3,
    ),
    Case(
        "gpus-libvirt-from-annotation",
        "kubevirt-gpus.xml",
        "cdevs",
        "unknown",
        annotations=((ANNOTATION_LIBVIRT_VERSION, "12.2.0"),),
        backends=("iommufd",) * 3,
    ),
    Case(
        "in-tree-cdevs", "kubevirt-gpus-in-tree.xml", "cdevs", "unknown", backends=("iommufd",) * 3
    ),
    Case(
        "in-tree-no-cdev-node",
        "kubevirt-gpus-in-tree.xml",
        "no-cdev-node",
        "12.9",
        backends=("iommufd", "legacy", "iommufd"),
    ),
    Case(
        "in-tree-legacy-kernel",
        "kubevirt-gpus-in-tree.xml",
        "legacy-kernel",
        "12.9",
        backends=("legacy",) * 3,
    ),
    Case(
        "in-tree-disabled",
        "kubevirt-gpus-in-tree.xml",
        "cdevs",
        "12.9",
        policy=Policy.DISABLE,
        backends=("legacy",) * 3,
    ),
    Case("mdev-usb-only", "kubevirt-mdev-usb.xml", "cdevs", "12.9"),
    Case(
        "interface-hostdev-12.9",
        "interface-hostdev.xml",
        "cdevs",
        "12.9",
        backends=("iommufd",) * 2,
    ),
    # KubeVirt 1.9's DRA path (HostDevicesWithDRA, GPUsWithDRA): <hostdev type='pci'
    # managed='no'> without `mode`, alias ua-dra-hostdevice-/ua-dra-gpu-<name>, never iommufd.
    Case(
        "dra-libvirt-12.9",
        "kubevirt-dra.xml",
        "cdevs",
        "12.9",
        backends=("iommufd",) * 2,
        vmi="vmi-dra.json",
    ),
    Case(
        "dra-libvirt-11.10",
        "kubevirt-dra.xml",
        "cdevs",
        "11.10",
        backends=("legacy",) * 2,
        vmi="vmi-dra.json",
    ),
    Case(
        "dra-mixed-libvirt-12.9",
        "kubevirt-dra-mixed.xml",
        "cdevs",
        "12.9",
        backends=("iommufd",) * 2,
        vmi="vmi-dra-mixed.json",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_golden(case: Case, tmp_path: Path, rng: etree.RelaxNG) -> None:
    source = read_data(case.fixture)
    caps = capabilities(NODES[case.node](tmp_path), source, LIBVIRT[case.libvirt])
    result = rewrite_domain(source, vmi_json(case.vmi, **dict(case.annotations)), caps, case.policy)

    golden = GOLDEN / f"{case.id}.xml"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_bytes(result.domain_xml)
    assert canonical(result.domain_xml) == canonical(golden.read_bytes())
    assert tuple(d.backend.value for d in result.decision.devices) == case.backends
    if not case.backends:
        assert result.domain_xml == source  # nothing to decide: not a byte changes

    assert schema_errors(rng, result.domain_xml) is None  # libvirt 12.9's RelaxNG grammar
    if not uses_iommufd_xml(result.domain_xml):
        assert libvirt_define_errors(result.domain_xml) is None  # the installed libvirt


@pytest.mark.parametrize(
    "fixture",
    [
        "kubevirt-gpus.xml",
        "kubevirt-gpus-in-tree.xml",
        "kubevirt-dra.xml",
        "kubevirt-dra-mixed.xml",
    ],
)
def test_fixtures_are_valid_libvirt_xml(fixture: str, rng: etree.RelaxNG) -> None:
    xml = read_data(fixture)
    assert schema_errors(rng, xml) is None
    if not uses_iommufd_xml(xml):
        assert libvirt_define_errors(xml) is None


def dra_aliases(vmi_fixture: str) -> list[str]:
    """The aliases KubeVirt's DRA path gives a VMI's DRA host devices and GPUs (an entry with a
    claimName and no deviceName), in the order its converter writes them."""
    devices = json.loads(read_data(vmi_fixture))["spec"]["domain"]["devices"]
    return [
        f"ua-dra-{kind}-{entry['name']}"
        for kind, entries in (("hostdevice", devices["hostDevices"]), ("gpu", devices["gpus"]))
        for entry in entries
        if "claimName" in entry and "deviceName" not in entry
    ]


def test_dra_devices_are_decided_by_address_and_cdev(tmp_path: Path) -> None:
    """DRA entries name a claim, not a resource: the hook goes by each <hostdev>'s PCI address
    and that function's cdev, so one DRA device can move while another stays."""
    root = NODES["cdevs"](tmp_path)
    (cdev,) = (root / "sys/bus/pci/devices/0000:3a:00.0/vfio-dev").iterdir()
    (root / "dev/vfio/devices" / cdev.name).unlink()
    source = read_data("kubevirt-dra.xml")
    caps = capabilities(root, source, LIBVIRT["12.9"])

    result = rewrite_domain(source, vmi_json("vmi-dra.json"), caps, Policy.AUTO)

    assert [(d.alias, str(d.bdf), d.backend.value) for d in result.decision.devices] == [
        ("ua-dra-hostdevice-nic1", "0000:5e:00.4", "iommufd"),
        ("ua-dra-gpu-gpu2", "0000:3a:00.0", "legacy"),
    ]
    assert [d.alias for d in result.decision.devices] == dra_aliases("vmi-dra.json")
    assert "no VFIO cdev node" in result.decision.devices[1].reason
    hostdevs = etree.fromstring(result.domain_xml).findall("devices/hostdev")
    assert [h.find("driver") is not None for h in hostdevs] == [False, True]
    assert all(h.get("mode") is None and h.get("managed") == "no" for h in hostdevs)


def test_decision_is_recorded_per_device(tmp_path: Path) -> None:
    source = read_data("kubevirt-gpus.xml")
    caps = capabilities(NODES["no-cdev-node"](tmp_path), source, LIBVIRT["12.9"])
    result = rewrite_domain(source, vmi_json(), caps, Policy.AUTO)

    record = etree.fromstring(result.domain_xml).find("metadata/d:decision", NS)
    assert record is not None
    assert record.get("policy") == "auto"
    assert record.get("libvirt") == "12.9.0"
    assert record.get("domain-iommufd") == "added"
    entries = [dict(e.attrib) for e in record.findall("d:hostdev", NS)]
    assert [(e["alias"], e["bdf"], e["backend"], e["change"]) for e in entries] == [
        ("ua-gpu-gpu1", GPU1, "iommufd", "none"),
        ("ua-hostdevice-gpu2", GPU2, "legacy", "driver"),
        ("ua-sriov-sriov-net1", VF, "iommufd", "none"),
    ]
    assert "/dev/vfio/devices/vfio1 is missing" in entries[1]["reason"]
    summary = result.decision.summary()
    assert summary.startswith(
        "vmi 'gpus/vmi-h100': policy auto: 'ua-gpu-gpu1' 0000:18:00.0 iommufd"
    )
    assert "'ua-hostdevice-gpu2' 0000:2a:00.0 legacy (no VFIO cdev node" in summary


def test_in_tree_iommufd_and_fdgroup_are_kept(tmp_path: Path) -> None:
    source = read_data("kubevirt-gpus-in-tree.xml")
    caps = capabilities(NODES["no-cdev-node"](tmp_path), source, LIBVIRT["12.9"])
    root = etree.fromstring(rewrite_domain(source, vmi_json(), caps, Policy.AUTO).domain_xml)
    (domain_iommufd,) = root.findall("iommufd")
    assert domain_iommufd.items() == [("enabled", "yes"), ("fdgroup", "iommu")]
    drivers = [h.find("driver") for h in root.iterfind("devices/hostdev[@type='pci']")]
    assert [None if d is None else d.items() for d in drivers] == [None, [("iommufd", "no")], None]


def test_existing_driver_keeps_its_attributes(tmp_path: Path, rng: etree.RelaxNG) -> None:
    root = etree.fromstring(read_data("kubevirt-gpus.xml"))
    gpu2 = root.findall("devices/hostdev[@type='pci']")[1]
    gpu2.insert(0, etree.Element("driver", name="vfio"))
    source = etree.tostring(root)
    caps = capabilities(NODES["cdevs"](tmp_path), source, LIBVIRT["12.1"])

    result = rewrite_domain(source, vmi_json(), caps, Policy.AUTO)

    out = etree.fromstring(result.domain_xml).findall("devices/hostdev[@type='pci']")[1]
    assert [d.items() for d in out.findall("driver")] == [[("name", "vfio"), ("iommufd", "yes")]]
    assert schema_errors(rng, result.domain_xml) is None
    assert canonical(undo_rewrite(result.domain_xml)) == canonical(source)


def test_driver_set_before_the_hook_is_respected(tmp_path: Path) -> None:
    root = etree.fromstring(read_data("kubevirt-gpus.xml"))
    gpu1 = root.find("devices/hostdev[@type='pci']")
    assert gpu1 is not None
    gpu1.insert(0, etree.Element("driver", iommufd="no"))
    source = etree.tostring(root)
    caps = capabilities(NODES["cdevs"](tmp_path), source, LIBVIRT["12.9"])

    result = rewrite_domain(source, vmi_json(), caps, Policy.AUTO)

    first = result.decision.devices[0]
    assert first.backend is Backend.LEGACY
    assert first.reason == "<driver iommufd='no'> set before this hook"
    with pytest.raises(IommufdRequired, match=r"'ua-gpu-gpu1' .* set before this hook"):
        rewrite_domain(source, vmi_json(), caps, Policy.REQUIRE)


def test_require_names_device_and_missing_capability(tmp_path: Path) -> None:
    source = read_data("kubevirt-gpus.xml")
    caps = capabilities(NODES["no-cdev-node"](tmp_path), source, LIBVIRT["12.9"])
    with pytest.raises(IommufdRequired) as raised:
        rewrite_domain(source, vmi_json(**{ANNOTATION_MODE: "require"}), caps, Policy.AUTO)
    message = str(raised.value)
    assert message.startswith("vmi 'gpus/vmi-h100': iommufd is required (policy require, from")
    assert raised.value.problems == (
        "hostdev 'ua-hostdevice-gpu2' (0000:2a:00.0) cannot use iommufd:"
        " no VFIO cdev node: /dev/vfio/devices/vfio1 is missing",
    )


@pytest.mark.parametrize(
    ("node", "libvirt", "missing"),
    [
        ("legacy-kernel", "12.9", "no iommufd: the kernel lacks CONFIG_IOMMUFD"),
        ("cdevs", "11.10", "libvirt 11.10.0 (--libvirt-version) predates iommufd"),
        ("cdevs", "unknown", "libvirt version unknown"),
    ],
    ids=["kernel", "old-libvirt", "unknown-libvirt"],
)
def test_require_fails_for_every_device(
    node: str, libvirt: str, missing: str, tmp_path: Path
) -> None:
    source = read_data("kubevirt-gpus.xml")
    caps = capabilities(NODES[node](tmp_path), source, LIBVIRT[libvirt])
    with pytest.raises(IommufdRequired) as raised:
        rewrite_domain(source, vmi_json(), caps, Policy.REQUIRE)
    assert len(raised.value.problems) == 3
    assert all(missing in problem for problem in raised.value.problems)


def test_require_met(tmp_path: Path) -> None:
    source = read_data("kubevirt-gpus.xml")
    caps = capabilities(NODES["cdevs"](tmp_path), source, LIBVIRT["12.9"])
    result = rewrite_domain(source, vmi_json(), caps, Policy.REQUIRE)
    assert {d.backend for d in result.decision.devices} == {Backend.IOMMUFD}


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({ANNOTATION_MODE: "always"}, "iommufd.kubevirt.io/mode: expected auto|require|disable"),
        ({ANNOTATION_LIBVIRT_VERSION: "twelve"}, "expected a libvirt version like 12.2.0"),
    ],
    ids=["mode", "libvirt-version"],
)
def test_bad_annotations_are_refused(annotations: dict[str, str], message: str) -> None:
    caps = Capabilities(kernel_iommufd=True, devices={}, libvirt=None)
    with pytest.raises(InvalidInput, match=message):
        rewrite_domain(read_data("kubevirt-gpus.xml"), vmi_json(**annotations), caps, Policy.AUTO)


@pytest.mark.parametrize(
    ("address", "bdf"),
    [
        ('domain="0x0000" bus="0x3b" slot="0x00" function="0x0"', Bdf(0, 0x3B, 0, 0)),
        ('bus="59" slot="1" function="7"', Bdf(0, 59, 1, 7)),
        ('domain="0x10000" bus="0xe1" slot="0x1f" function="0x3"', Bdf(0x10000, 0xE1, 0x1F, 3)),
        ('domain="0x0000" bus="0x3b" slot="0x20" function="0x0"', None),
        ('domain="0x0000" bus="zz" slot="0x00" function="0x0"', None),
        ('domain="0x0000" bus="0x3b" slot="0x00"', None),
    ],
    ids=[
        "hex",
        "decimal-no-domain",
        "vmd-domain",
        "slot-out-of-range",
        "not-a-number",
        "no-function",
    ],
)
def test_source_address_forms(address: str, bdf: Bdf | None) -> None:
    xml = (
        "<domain type='kvm'><name>d</name><memory>1</memory><os><type>hvm</type></os><devices>"
        f"<hostdev mode='subsystem' type='pci' managed='no'><source><address {address}/></source>"
        "<alias name='ua-hostdevice-x'/></hostdev></devices></domain>"
    ).encode()
    devices = {bdf: DeviceSupport("vfio0", None)} if bdf else {}
    caps = Capabilities(True, devices, Sourced(LibvirtVersion(12, 9), "--libvirt-version"))
    (decision,) = rewrite_domain(xml, b"", caps, Policy.AUTO).decision.devices
    assert decision.bdf == bdf
    assert decision.backend is (Backend.IOMMUFD if bdf else Backend.LEGACY)
