"""Properties of the rewrite over generated domains, capabilities, policies and VMIs.

Bounded and seeded (`derandomize`, explicit `max_examples`): the same examples on every run,
a few seconds per property. Beyond valid KubeVirt-like domains they feed the hook stale and forged
records of its own, mangled bytes and arbitrary VMI JSON: it may refuse (its own errors) but never
crashes, and what it writes parses, is idempotent and drops nothing outside its own doing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from hook_kit import canonical, load_domain_schema, read_data, schema_errors
from hostdev.bdf import Bdf
from launcher_hook.domain import DECISION_NS, rewrite_domain, undo_rewrite
from launcher_hook.errors import HookError, IommufdRequired
from launcher_hook.model import (
    ANNOTATION_LIBVIRT_VERSION,
    ANNOTATION_MODE,
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
def records(draw: st.DrawFn) -> etree._Element:
    """A `<decision>` as an earlier pass might have left it, or as someone forged it: its entries
    may or may not line up with the domain's devices, and its claims may or may not be true."""
    # A default namespace, as the hook writes it; lxml-stubs forget that None is a valid key.
    record = etree.Element(RECORD, nsmap={None: DECISION_NS})  # type: ignore[dict-item]
    record.set("policy", "auto")
    record.set("domain-iommufd", draw(st.sampled_from(("added", "kept", "absent", "bogus"))))
    if draw(st.booleans()):
        record.set("metadata", "added")
    for _ in range(draw(st.integers(0, 4))):
        entry = etree.SubElement(record, f"{{{DECISION_NS}}}hostdev")
        entry.set("alias", draw(st.sampled_from(ALIASES)) or "")
        entry.set("bdf", str(draw(st.sampled_from(POOL))))
        entry.set("backend", draw(st.sampled_from(("iommufd", "legacy"))))
        entry.set("change", draw(st.sampled_from(("none", "driver", "attribute", "bogus"))))
    return record


@st.composite
def domains(draw: st.DrawFn, stale_records: bool = False) -> bytes:
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
    if stale_records:
        found = root.find("metadata")
        holder = etree.SubElement(root, "metadata") if found is None else found
        for record in draw(st.lists(records(), min_size=1, max_size=2)):
            holder.insert(draw(st.integers(0, len(holder))), record)
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

SETTINGS = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
RECORD = f"{{{DECISION_NS}}}decision"


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


@SETTINGS
@given(domains(stale_records=True), capabilities, policies)
def test_stale_records_idempotent_and_nothing_else_dropped(
    rng: etree.RelaxNG, xml: bytes, caps: Capabilities, policy: Policy
) -> None:
    """Over records of ours that are stale or forged: one record comes out (none without PCI
    host devices), a second pass changes nothing, and apart from what the hook itself writes
    (its record, a bare `<iommufd enabled='yes'/>`, `iommufd` on a `<driver>`) nothing differs
    from the input."""
    once = rewrite_or_none(xml, caps, policy)
    if once is None:
        return
    found = etree.fromstring(once.domain_xml).findall(f"metadata/{RECORD}")
    assert len(found) == (1 if once.decision.devices else 0)
    assert rewrite_domain(once.domain_xml, b"", caps, policy).domain_xml == once.domain_xml
    assert _outside_the_hook(once.domain_xml) == _outside_the_hook(xml)
    undone = undo_rewrite(once.domain_xml)
    assert etree.fromstring(undone).find(f"metadata/{RECORD}") is None
    assert schema_errors(rng, once.domain_xml) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)
names = st.one_of(
    st.text(max_size=12),
    st.sampled_from(("vmi-h100", "x\nCRITICAL forged", "\ud800", "\u202e" * 3, "a" * 300)),
    json_values,
)
annotation_values = st.one_of(
    st.sampled_from(("auto", "require", "disable", "12.9.0", "12.1", "9.0.0", " 12.2 ", "1.2.3.4")),
    st.text(max_size=12),
    json_values,
)


@st.composite
def vmis(draw: st.DrawFn) -> bytes:
    """VMI JSON as virt-launcher or anyone else may pass it: shaped like a VMI with values of
    any type, any JSON at all, or not JSON."""
    kind = draw(st.sampled_from(("shaped", "any-json", "bytes")))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "any-json":
        return json.dumps(draw(json_values)).encode()
    metadata = {key: draw(names) for key in ("name", "namespace") if draw(st.booleans())}
    keys = st.sampled_from((ANNOTATION_MODE, ANNOTATION_LIBVIRT_VERSION, "kubevirt.io/x"))
    metadata["annotations"] = draw(
        st.one_of(st.dictionaries(keys, annotation_values, max_size=3), json_values)
    )
    return json.dumps({"metadata": draw(st.one_of(st.just(metadata), json_values))}).encode()


@SETTINGS
@given(vmis(), capabilities, policies)
def test_any_vmi_json_is_decided_or_refused(vmi: bytes, caps: Capabilities, policy: Policy) -> None:
    xml = read_data("kubevirt-gpus.xml")
    try:
        result = rewrite_domain(xml, vmi, caps, policy)
    except HookError as error:
        assert str(error).isprintable(), repr(str(error))
        return
    assert result.decision.summary().isprintable()
    assert rewrite_domain(result.domain_xml, vmi, caps, policy).domain_xml == result.domain_xml


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A KubeVirt domain with a few byte ranges cut out, repeated or replaced by junk."""
    xml = bytearray(read_data("kubevirt-gpus.xml"))
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, len(xml)))
        end = draw(st.integers(start, min(len(xml), start + 40)))
        junk = draw(
            st.one_of(
                st.binary(max_size=8),
                st.sampled_from((b"<", b"&", b"]]>", b"<hostdev type='pci'>", b"\x00", b"\xff")),
                st.just(bytes(xml[start:end]) * 2),
            )
        )
        xml[start:end] = junk
    return bytes(xml)


@settings(SETTINGS, max_examples=300)
@given(mangled(), capabilities, policies)
def test_mangled_domains_are_refused_or_rewritten(
    xml: bytes, caps: Capabilities, policy: Policy
) -> None:
    try:
        once = rewrite_domain(xml, b"", caps, policy).domain_xml
    except HookError as error:
        assert str(error).isprintable(), repr(str(error))
        return
    assert etree.fromstring(once).tag == "domain"
    assert rewrite_domain(once, b"", caps, policy).domain_xml == once


def _outside_the_hook(xml: bytes) -> str:
    """The document without what the hook writes and takes out, whitespace aside."""
    root = etree.fromstring(xml)
    for metadata in root.findall("metadata"):
        for record in metadata.findall(RECORD):
            metadata.remove(record)
        if len(metadata) == 0:
            root.remove(metadata)
    for element in root.findall("iommufd"):
        if element.items() == [("enabled", "yes")]:
            root.remove(element)
    for hostdev in root.iterfind("devices/hostdev"):
        for driver in hostdev.findall("driver"):
            if "iommufd" in driver.attrib:
                del driver.attrib["iommufd"]
            if not driver.attrib and len(driver) == 0:
                hostdev.remove(driver)
    text: str = etree.canonicalize(etree.tostring(root).decode(), strip_text=True)
    return text
