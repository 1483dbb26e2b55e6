"""Properties of the rewrite over generated domains, capabilities and policies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from hook_testkit import canonical, load_domain_schema, schema_errors
from hostdev.bdf import Bdf
from launcher_hook.domain import rewrite_domain, undo_rewrite
from launcher_hook.errors import IommufdRequired
from launcher_hook.model import (
    Capabilities,
    DeviceSupport,
    LibvirtVersion,
    Policy,
    Rewrite,
    Sourced,
)

POOL = (Bdf(0, 0x18, 0, 0), Bdf(0, 0x2A, 0, 0), Bdf(0, 0x5E, 0, 2), Bdf(0x10000, 0xE1, 0, 1))
ALIASES = ("ua-gpu-gpu1", "ua-hostdevice-gpu2", "ua-sriov-net1", None)
DRIVERS: tuple[dict[str, str] | None, ...] = (
    None,
    {"name": "vfio"},
    {"iommufd": "yes"},
    {"iommufd": "no"},
    {"name": "vfio", "iommufd": "no"},
)
VERSIONS = (None, LibvirtVersion(9, 0), LibvirtVersion(12, 1), LibvirtVersion(12, 2, 1))


@pytest.fixture(scope="session")
def rng() -> etree.RelaxNG:
    return load_domain_schema()


@dataclass(frozen=True)
class Pci:
    bdf: Bdf
    alias: str | None
    driver: dict[str, str] | None
    alias_first: bool
    driver_after_source: bool


@dataclass(frozen=True)
class Other:
    """A device the hook must never touch."""

    xml: str


OTHERS = (
    Other(
        "<hostdev mode='subsystem' type='mdev' model='vfio-pci' managed='no'><source>"
        "<address uuid='b1ed8c5a-1f2e-4d3c-9b8a-7f6e5d4c3b2a'/></source>"
        "<alias name='ua-gpu-vgpu1'/></hostdev>"
    ),
    Other(
        "<hostdev mode='subsystem' type='usb' managed='no'><source><address bus='1' device='3'/>"
        "</source><alias name='ua-usb-key'/></hostdev>"
    ),
    Other(
        "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/>"
        "<address bus='0' target='0' unit='0'/></source><alias name='ua-scsi'/></hostdev>"
    ),
    Other(
        "<interface type='hostdev' managed='no'><source><address type='pci' domain='0x0000'"
        " bus='0x5e' slot='0x00' function='0x3'/></source><mac address='02:00:00:00:00:02'/>"
        "</interface>"
    ),
    Other("<controller type='usb' index='0' model='qemu-xhci'/>"),
    Other("<!-- a comment among the devices -->"),
)


@st.composite
def domains(draw: st.DrawFn) -> bytes:
    devices = draw(
        st.lists(
            st.one_of(
                st.builds(
                    Pci,
                    st.sampled_from(POOL),
                    st.sampled_from(ALIASES),
                    st.sampled_from(DRIVERS),
                    st.booleans(),
                    st.booleans(),
                ),
                st.sampled_from(OTHERS),
            ),
            max_size=6,
        )
    )
    root = etree.Element("domain", type="kvm")
    etree.SubElement(root, "name").text = "ns_vmi"
    etree.SubElement(root, "memory", unit="b").text = "1073741824"
    os_element = etree.SubElement(root, "os")
    etree.SubElement(os_element, "type", arch="x86_64", machine="q35").text = "hvm"
    domain_iommufd = draw(st.sampled_from((None, "yes", "no")))
    if domain_iommufd is not None:
        element = etree.SubElement(root, "iommufd", enabled=domain_iommufd)
        if draw(st.booleans()):
            element.set("fdgroup", "iommu")
    container = etree.SubElement(root, "devices")
    for device in devices:
        container.append(_device(device))
    if draw(st.booleans()):
        metadata = etree.SubElement(root, "metadata")
        kubevirt = etree.fromstring(
            '<kubevirt xmlns="http://kubevirt.io"><uid>d7a6</uid></kubevirt>'
        )
        metadata.append(kubevirt)
    return etree.tostring(root, pretty_print=draw(st.booleans()))


def _device(device: Pci | Other) -> etree._Element:
    if isinstance(device, Other):
        if device.xml.startswith("<!--"):
            return etree.Comment(device.xml.removeprefix("<!--").partition("-->")[0])
        return etree.fromstring(device.xml)
    hostdev = etree.Element("hostdev", mode="subsystem", type="pci", managed="no")
    if device.alias is not None and device.alias_first:
        etree.SubElement(hostdev, "alias", name=device.alias)
    # libxml2's RelaxNG wants <driver> next to <source> (see launcher_hook.domain).
    if device.driver is not None and not device.driver_after_source:
        etree.SubElement(hostdev, "driver", device.driver)
    source = etree.SubElement(hostdev, "source")
    b = device.bdf
    etree.SubElement(
        source,
        "address",
        type="pci",
        domain=f"0x{b.domain:04x}",
        bus=f"0x{b.bus:02x}",
        slot=f"0x{b.slot:02x}",
        function=f"0x{b.function:x}",
    )
    if device.driver is not None and device.driver_after_source:
        etree.SubElement(hostdev, "driver", device.driver)
    if device.alias is not None and not device.alias_first:
        etree.SubElement(hostdev, "alias", name=device.alias)
    return hostdev


supports = st.one_of(
    st.just(DeviceSupport("vfio0", None)),
    st.just(DeviceSupport(None, "no VFIO cdev node: /dev/vfio/devices/vfio0 is missing")),
)
capabilities = st.builds(
    Capabilities,
    kernel_iommufd=st.booleans(),
    devices=st.dictionaries(st.sampled_from(POOL), supports),
    libvirt=st.sampled_from(VERSIONS).map(
        lambda v: None if v is None else Sourced(v, "--libvirt-version")
    ),
)
policies = st.sampled_from(list(Policy))

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rewrite_or_none(xml: bytes, caps: Capabilities, policy: Policy) -> Rewrite | None:
    try:
        return rewrite_domain(xml, b"", caps, policy)
    except IommufdRequired:
        return None  # require unmet: nothing written, nothing to check


@SETTINGS
@given(domains(), capabilities, policies)
def test_idempotent(xml: bytes, caps: Capabilities, policy: Policy) -> None:
    once = rewrite_or_none(xml, caps, policy)
    if once is None:
        return
    twice = rewrite_domain(once.domain_xml, b"", caps, policy)
    assert twice.domain_xml == once.domain_xml
    assert twice.decision == once.decision


@SETTINGS
@given(domains(), capabilities, policies)
def test_undo_gives_back_the_input(xml: bytes, caps: Capabilities, policy: Policy) -> None:
    result = rewrite_or_none(xml, caps, policy)
    if result is None:
        return
    assert undo_rewrite(result.domain_xml) == xml
    assert canonical(undo_rewrite(result.domain_xml)) == canonical(xml)


@SETTINGS
@given(domains(), capabilities, policies)
def test_non_pci_devices_never_change(xml: bytes, caps: Capabilities, policy: Policy) -> None:
    result = rewrite_or_none(xml, caps, policy)
    if result is None:
        return
    assert _untouchable(result.domain_xml) == _untouchable(xml)


@SETTINGS
@given(domains(), capabilities, policies)
def test_output_is_valid_when_input_is(
    rng: etree.RelaxNG, xml: bytes, caps: Capabilities, policy: Policy
) -> None:
    assert schema_errors(rng, xml) is None  # the generator makes only valid domains
    result = rewrite_or_none(xml, caps, policy)
    if result is not None:
        assert schema_errors(rng, result.domain_xml) is None


def _untouchable(xml: bytes) -> list[str]:
    """Every child of <devices> except PCI subsystem hostdevs, serialised, in order. (lxml's
    per-element C14N crashes on comment nodes; both sides come from one serialiser anyway.)"""
    devices = etree.fromstring(xml).find("devices")
    assert devices is not None
    return [
        etree.tostring(child, with_tail=False).decode()
        for child in devices
        if not (child.tag == "hostdev" and child.get("type") == "pci")
    ]
