"""The rewrite: (domain XML, VMI JSON, capabilities, policy) → (new domain XML, decision). No IO.

Only `<hostdev mode='subsystem' type='pci'>` elements, the domain-wide `<iommufd>` and this
hook's own record in `<metadata>` are ever touched; everything else — KubeVirt's metadata,
`qemu:commandline`, comments, namespaces, mdev/USB/SCSI host devices — passes through as parsed.

The record (namespace `DECISION_NS`, see docs/launcher-hook.md) lists, per PCI host device, the
alias, PCI address, backend and reason, and what this hook added. A second pass over our own
output — a chained copy of this hook, or virt-launcher defining the domain again — first takes
those additions back out — only where they are still exactly as written, and for every record of
ours — and then decides afresh, so the rewrite is idempotent by construction and the additions
can always be undone exactly (`undo_rewrite`) without touching what someone else changed.
"""

from __future__ import annotations

from collections.abc import Iterator

from lxml import etree

from hostdev.bdf import Bdf
from launcher_hook.decide import (
    PciHostdev,
    Plan,
    check_required,
    plan_devices,
    resolve_libvirt,
    resolve_policy,
)
from launcher_hook.model import Backend, Capabilities, Decision, Policy, Rewrite
from launcher_hook.parse import parse_domain_xml, parse_vmi, serialize_domain

DECISION_NS = "https://kubevirt-iommufd.io/xmlns/decision/v1"
_RECORD = f"{{{DECISION_NS}}}decision"
_ENTRY = f"{{{DECISION_NS}}}hostdev"
_INDENT_STEP = "  "
# PCI address fields as libvirt's schema bounds them: domain 32 bits, bus 8, slot 5, function 3.
_ADDRESS_LIMITS = (("domain", 0xFFFFFFFF), ("bus", 0xFF), ("slot", 0x1F), ("function", 0x7))


def rewrite_domain(
    domain_xml: bytes, vmi_json: bytes, caps: Capabilities, policy: Policy
) -> Rewrite:
    """Move the domain's PCI host devices to iommufd where node, device, libvirt and policy allow.

    Raises InvalidInput for a malformed or unsafe document or VMI, IommufdRequired when the
    policy is `require` and some PCI host device cannot use iommufd.
    """
    vmi = parse_vmi(vmi_json)
    tree = parse_domain_xml(domain_xml)
    root = tree.getroot()
    undone = _undo(root)
    elements = list(_pci_hostdevs(root))
    decided_policy = resolve_policy(policy, vmi)
    libvirt = resolve_libvirt(caps, vmi)
    if not elements:
        decision = Decision(vmi, decided_policy, libvirt, ())
        output = serialize_domain(tree, domain_xml) if undone else domain_xml
        return Rewrite(output, decision)
    hostdevs = [_read_hostdev(element) for element in elements]
    existing = root.find("iommufd")
    plan = plan_devices(
        hostdevs,
        None if existing is None else existing.get("enabled", "no"),
        root.find("devices/interface[@type='hostdev']") is not None,
        caps,
        decided_policy,
        libvirt,
    )
    check_required(plan, decided_policy, vmi)
    changes = [
        _apply_device(element, p.driver_iommufd)
        for element, p in zip(elements, plan.devices, strict=True)
    ]
    if plan.add_domain_iommufd:
        devices = root.find("devices")
        assert devices is not None  # a PCI hostdev was found in it
        _insert(root, root.index(devices), etree.Element("iommufd", enabled="yes"))
    domain_state = (
        "added" if plan.add_domain_iommufd else "kept" if existing is not None else "absent"
    )
    decision = Decision(vmi, decided_policy, libvirt, tuple(p.decision for p in plan.devices))
    _record(root, decision, plan, changes, domain_state)
    return Rewrite(serialize_domain(tree, domain_xml), decision)


def pci_sources(domain_xml: bytes) -> tuple[Bdf, ...]:
    """PCI addresses of the domain's PCI host devices: what capability detection has to look at."""
    root = parse_domain_xml(domain_xml).getroot()
    found = (_source_bdf(hostdev) for hostdev in _pci_hostdevs(root))
    return tuple(bdf for bdf in found if bdf is not None)


def undo_rewrite(domain_xml: bytes) -> bytes:
    """The domain as it was before this hook, from the record the hook left in it."""
    tree = parse_domain_xml(domain_xml)
    return serialize_domain(tree, domain_xml) if _undo(tree.getroot()) else domain_xml


def _pci_hostdevs(root: etree._Element) -> Iterator[etree._Element]:
    for hostdev in root.iterfind("devices/hostdev"):
        # libvirt reads a hostdev without `mode` as a subsystem one.
        if hostdev.get("mode", "subsystem") == "subsystem" and hostdev.get("type") == "pci":
            yield hostdev


def _read_hostdev(element: etree._Element) -> PciHostdev:
    alias = element.find("alias")
    driver = element.find("driver")
    return PciHostdev(
        alias=None if alias is None else alias.get("name"),
        bdf=_source_bdf(element),
        preset=None if driver is None else driver.get("iommufd"),
    )


def _source_bdf(hostdev: etree._Element) -> Bdf | None:
    address = hostdev.find("source/address")
    if address is None:
        return None
    fields = []
    for name, limit in _ADDRESS_LIMITS:
        # libvirt takes 0x-prefixed hex or decimal; a missing domain means 0.
        text = address.get(name, "0" if name == "domain" else "")
        try:
            value = int(text, 16) if text.lower().startswith("0x") else int(text, 10)
        except ValueError:
            return None
        if not 0 <= value <= limit:
            return None
        fields.append(value)
    return Bdf(*fields)


def _apply_device(hostdev: etree._Element, iommufd: str | None) -> str:
    """Set `<driver iommufd=…>` on one hostdev; say what was added, for the record."""
    if iommufd is None:
        return "none"
    driver = hostdev.find("driver")
    if driver is not None:
        driver.set("iommufd", iommufd)
        return "attribute"
    # libvirt's grammar puts <driver> and <source> in one interleave nested in the hostdev's, and
    # libxml2's RelaxNG (what `virsh define --validate` runs) then wants them side by side:
    # <driver> after <alias> and away from <source> fails. Right before <source> always passes
    # and is where libvirt itself writes it.
    source = hostdev.find("source")
    _insert(
        hostdev,
        0 if source is None else hostdev.index(source),
        etree.Element("driver", iommufd=iommufd),
    )
    return "driver"


def _record(
    root: etree._Element,
    decision: Decision,
    plan: Plan,
    changes: list[str],
    domain_state: str,
) -> None:
    # A default namespace, as KubeVirt writes its own; lxml-stubs forget that None is a valid key.
    record = etree.Element(_RECORD, nsmap={None: DECISION_NS})  # type: ignore[dict-item]
    record.set("policy", decision.policy.value.value)
    record.set("policy-source", decision.policy.source)
    if decision.libvirt is not None:
        record.set("libvirt", str(decision.libvirt.value))
        record.set("libvirt-source", decision.libvirt.source)
    record.set("domain-iommufd", domain_state)
    for device, change in zip(plan.devices, changes, strict=True):
        entry = etree.SubElement(record, _ENTRY)
        entry.set("alias", device.decision.alias or "")
        entry.set("bdf", str(device.decision.bdf or ""))
        entry.set("backend", device.decision.backend.value)
        entry.set("reason", device.decision.reason)
        entry.set("change", change)
    metadata = root.find("metadata")
    if metadata is None:
        record.set("metadata", "added")
        metadata = etree.Element("metadata")
        devices = root.find("devices")
        assert devices is not None
        _insert(root, root.index(devices) + 1, metadata)
    _insert(metadata, 0, record)
    indent = _indent_before(metadata, 0)
    if indent is not None:
        inner = indent + _INDENT_STEP
        record.text = inner
        for entry in record:
            entry.tail = inner
        record[-1].tail = indent


def _undo(root: etree._Element) -> bool:
    """Take out what earlier passes of this hook added; True when there was such a pass.

    Every record of ours is undone, newest (first) to oldest, and each takes out only an element
    or attribute that is still exactly what the hook wrote: one someone changed since, or one a
    stale record merely claims, is theirs and stays.
    """
    found = [
        (metadata, record)
        for metadata in root.iterfind("metadata")
        for record in metadata.iterfind(_RECORD)
    ]
    for metadata, record in found:
        _undo_record(root, record)
        metadata.remove(record)
        if record.get("metadata") == "added" and _is_empty(metadata):
            root.remove(metadata)
    return bool(found)


def _undo_record(root: etree._Element, record: etree._Element) -> None:
    for entry, hostdev in zip(record.iterfind(_ENTRY), _pci_hostdevs(root), strict=False):
        found = _read_hostdev(hostdev)
        if entry.get("alias") != (found.alias or "") or entry.get("bdf") != str(found.bdf or ""):
            continue
        driver = hostdev.find("driver")
        change = entry.get("change")
        # The hook writes iommufd='yes' only on a device it moved, 'no' only on one it kept.
        written = "yes" if entry.get("backend") == Backend.IOMMUFD.value else "no"
        if driver is None or change not in ("driver", "attribute"):
            continue
        if driver.get("iommufd") != written:
            continue
        if change == "driver" and driver.items() == [("iommufd", written)] and _is_empty(driver):
            hostdev.remove(driver)
        else:
            del driver.attrib["iommufd"]
    if record.get("domain-iommufd") == "added":
        domain_iommufd = root.find("iommufd")
        if (
            domain_iommufd is not None
            and domain_iommufd.items() == [("enabled", "yes")]
            and _is_empty(domain_iommufd)
        ):
            root.remove(domain_iommufd)


def _is_empty(element: etree._Element) -> bool:
    return len(element) == 0 and not (element.text or "").strip()


def _insert(parent: etree._Element, index: int, element: etree._Element) -> None:
    """Insert keeping the document's indentation; lxml drops the tail with the element, so
    removing it again restores the text exactly."""
    element.tail = _indent_before(parent, index)
    parent.insert(index, element)


def _indent_before(parent: etree._Element, index: int) -> str | None:
    text = parent.text if index == 0 else parent[index - 1].tail
    if not text or "\n" not in text:
        return None
    last_line = text.rsplit("\n", 1)[1]
    return "\n" + last_line if not last_line.strip() else None
