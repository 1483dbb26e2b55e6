"""The undo takes back exactly what the hook wrote: an element someone changed since, or one a
record only claims, stays; every record of ours is undone, so undo and rewrite are idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest
from lxml import etree

from hook_kit import LIBVIRT, NODES, canonical, capabilities, read_data, vmi_json
from launcher_hook.domain import DECISION_NS, rewrite_domain, undo_rewrite
from launcher_hook.model import Policy

NS = {"d": DECISION_NS}


def rewritten(tmp_path: Path, node: str, libvirt: str) -> bytes:
    source = read_data("kubevirt-gpus.xml")
    caps = capabilities(NODES[node](tmp_path), source, LIBVIRT[libvirt])
    return rewrite_domain(source, vmi_json(), caps, Policy.AUTO).domain_xml


def edited(xml: bytes, path: str, **attributes: str) -> bytes:
    """`xml` with the first element at `path` given exactly `attributes`."""
    root = etree.fromstring(xml)
    element = root.find(path)
    assert element is not None, path
    element.attrib.clear()
    for name, value in attributes.items():
        element.set(name, value)
    return etree.tostring(root)


def records(xml: bytes) -> list[etree._Element]:
    return etree.fromstring(xml).findall("metadata/d:decision", NS)


@pytest.mark.parametrize(
    "owner",
    [{"enabled": "no"}, {"enabled": "yes", "fdgroup": "iommu"}],
    ids=["disabled", "fdgroup"],
)
def test_domain_iommufd_changed_since_is_kept(tmp_path: Path, owner: dict[str, str]) -> None:
    output = rewritten(tmp_path, "cdevs", "12.9")
    assert records(output)[0].get("domain-iommufd") == "added"
    changed = edited(output, "iommufd", **owner)

    undone = etree.fromstring(undo_rewrite(changed))

    assert [dict(e.items()) for e in undone.findall("iommufd")] == [owner]
    assert undone.find("metadata/d:decision", NS) is None


def test_domain_iommufd_as_added_is_removed(tmp_path: Path) -> None:
    output = rewritten(tmp_path, "cdevs", "12.9")
    assert canonical(undo_rewrite(output)) == canonical(read_data("kubevirt-gpus.xml"))


@pytest.mark.parametrize(
    ("libvirt", "node", "device", "owner"),
    [
        ("12.1", "cdevs", 0, {"iommufd": "no"}),
        ("12.9", "no-cdev-node", 1, {"iommufd": "yes"}),
        ("12.9", "no-cdev-node", 1, {"iommufd": "no", "name": "vfio"}),
    ],
    ids=["yes-turned-no", "no-turned-yes", "attribute-added"],
)
def test_driver_changed_since_is_kept(
    tmp_path: Path, libvirt: str, node: str, device: int, owner: dict[str, str]
) -> None:
    output = rewritten(tmp_path, node, libvirt)
    entry = records(output)[0].findall("d:hostdev", NS)[device]
    assert entry.get("change") == "driver"
    path = f"devices/hostdev[@type='pci'][{device + 1}]/driver"
    changed = edited(output, path, **owner)

    undone = etree.fromstring(undo_rewrite(changed))

    driver = undone.find(path)
    assert driver is not None
    # An extra attribute makes it someone else's element; only our iommufd is taken out of it.
    expected = {"name": "vfio"} if "name" in owner else owner
    assert dict(driver.items()) == expected


def test_attribute_changed_since_is_kept(tmp_path: Path) -> None:
    root = etree.fromstring(read_data("kubevirt-gpus.xml"))
    hostdev = root.find("devices/hostdev[@type='pci'][2]")
    assert hostdev is not None
    hostdev.insert(0, etree.Element("driver", name="vfio"))
    source = etree.tostring(root)
    caps = capabilities(NODES["no-cdev-node"](tmp_path), source, LIBVIRT["12.9"])
    output = rewrite_domain(source, vmi_json(), caps, Policy.AUTO).domain_xml
    assert records(output)[0].findall("d:hostdev", NS)[1].get("change") == "attribute"
    path = "devices/hostdev[@type='pci'][2]/driver"
    changed = edited(output, path, name="vfio", iommufd="yes")

    driver = etree.fromstring(undo_rewrite(changed)).find(path)
    assert driver is not None
    assert dict(driver.items()) == {"name": "vfio", "iommufd": "yes"}


def test_every_record_of_ours_is_undone(tmp_path: Path) -> None:
    """A second, stale record (an older copy of this hook's output pasted along, a hook that
    did not undo) is undone too, in the same pass."""
    output = rewritten(tmp_path, "no-cdev-node", "12.9")
    root = etree.fromstring(output)
    metadata = root.find("metadata")
    assert metadata is not None
    (record,) = records(output)
    metadata.append(etree.fromstring(etree.tostring(record)))
    twice_recorded = etree.tostring(root)

    undone = undo_rewrite(twice_recorded)

    assert records(undone) == []
    assert canonical(undone) == canonical(read_data("kubevirt-gpus.xml"))
    assert undo_rewrite(undone) == undone


def test_rewrite_over_two_records_leaves_one(tmp_path: Path) -> None:
    output = rewritten(tmp_path, "no-cdev-node", "12.9")
    root = etree.fromstring(output)
    metadata = root.find("metadata")
    assert metadata is not None
    metadata.append(etree.fromstring(etree.tostring(records(output)[0])))
    source = etree.tostring(root)
    caps = capabilities(NODES["no-cdev-node"](tmp_path / "again"), source, LIBVIRT["12.9"])

    once = rewrite_domain(source, vmi_json(), caps, Policy.AUTO).domain_xml
    twice = rewrite_domain(once, vmi_json(), caps, Policy.AUTO).domain_xml

    assert len(records(once)) == 1
    assert twice == once
    assert canonical(once) == canonical(output)
