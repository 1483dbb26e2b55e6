"""The `inspect` report: one JSON-ready document built from an inventory, and its table form.

Both outputs come from the same document, so the table can never say something the JSON does not.
The document's shape is versioned by its `schema` field and described in docs/inspect-json.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hostdev.assess import assess_function
from hostdev.bdf import Bdf
from hostdev.model import HostCapabilities, HostInventory, IommuGroup, PciFunction
from hostdev.pciids import PciIds

SCHEMA = "kubevirt-iommufd/inspect/v1"
_NAME_WIDTH = 48

Document = dict[str, Any]


def build_report(
    inventory: HostInventory,
    names: PciIds,
    only: Iterable[Bdf] = (),
    labels: Mapping[str, str] | None = None,
    claims: Mapping[Bdf, str] | None = None,
) -> Document:
    """The report for every function, or for the groups of the functions in `only`; with the
    node labels (`hostdev.labels.node_labels`) the node would get when `labels` is given, and, when
    `claims` is given (the DRA driver's state was read), the claim each function is prepared
    for."""
    wanted = set(only)
    functions = [
        f
        for f in inventory.functions
        if not wanted or f.bdf in wanted or _shares_group(f, wanted, inventory)
    ]
    devices = [_device(f, inventory, names) for f in functions]
    if claims is not None:
        for function, device in zip(functions, devices, strict=True):
            device["prepared_for"] = claims.get(function.bdf)
    groups: dict[int | None, list[Document]] = {}
    for function, device in zip(functions, devices, strict=True):
        groups.setdefault(function.iommu_group, []).append(device)
    ordered = sorted(groups.items(), key=lambda item: (item[0] is None, item[0] or 0))
    document: Document = {
        "schema": SCHEMA,
        "host": _host(inventory.capabilities),
        "summary": {
            "functions": len(devices),
            "groups": sum(1 for number, _ in ordered if number is not None),
            "assignable": sum(1 for d in devices if d["assignable"]),
            "iommufd": sum(1 for d in devices if d["backend"] == "iommufd"),
            "legacy": sum(1 for d in devices if d["backend"] == "legacy"),
        },
        "groups": [_group(inventory.group(number), number, members) for number, members in ordered],
    }
    if labels is not None:
        document["labels"] = dict(labels)
    return document


def _shares_group(function: PciFunction, wanted: set[Bdf], inventory: HostInventory) -> bool:
    group = inventory.group_of(function)
    return group is not None and any(m.bdf in wanted for m in group.members)


def _host(caps: HostCapabilities) -> Document:
    return {
        "kernel": caps.kernel_release,
        "iommu": caps.iommu,
        "iommufd": caps.iommufd,
        "iommufd_node": "/dev/iommu" if caps.iommufd_node_present else None,
        "iommufd_devnum": caps.iommufd_devnum,
        "vfio_cdev": caps.vfio_cdev,
        "legacy_vfio": caps.legacy_vfio_node_present,
    }


def _group(group: IommuGroup | None, number: int | None, devices: list[Document]) -> Document:
    return {
        "group": number,
        "viable": None if group is None else group.viable,
        "legacy_node": group.legacy_node if group and group.legacy_node_present else None,
        "other_members": [] if group is None else [m.name for m in group.members if m.bdf is None],
        "functions": devices,
    }


def _device(function: PciFunction, inventory: HostInventory, names: PciIds) -> Document:
    verdict = assess_function(function, inventory)
    vendor, device = function.vendor_id, function.device_id
    document: Document = {
        "bdf": str(function.bdf),
        "vendor_id": f"{vendor:04x}",
        "device_id": f"{device:04x}",
        "vendor": names.vendor_name(vendor),
        "device": names.device_name(vendor, device),
        "subsystem_vendor_id": _hex4(function.subsystem_vendor_id),
        "subsystem_device_id": _hex4(function.subsystem_device_id),
        "class": f"{function.class_code:06x}",
        "class_name": names.class_name(function.class_code),
        "revision": None if function.revision is None else f"{function.revision:02x}",
        "driver": function.driver,
        "iommu_group": function.iommu_group,
        "numa_node": function.numa_node,
        "vfio_cdev": function.vfio_cdev,
        "vfio_cdev_path": function.cdev_path,
        "vfio_cdev_present": function.vfio_cdev_present,
        "sriov": (
            None
            if function.sriov is None
            else {"total_vfs": function.sriov.total_vfs, "num_vfs": function.sriov.num_vfs}
        ),
        "physfn": None if function.physfn is None else str(function.physfn),
        "consumers": [str(b) for b in function.consumers],
        "upstream": [str(b) for b in function.upstream],
        "modalias": function.modalias,
        "assignable": verdict.assignable,
        "backend": None if verdict.backend is None else verdict.backend.value,
        "reasons": list(verdict.reasons),
    }
    if function.reset_methods is not None:
        # Present when discovery read them (`inspect` does; scan_host(reset_methods=True)).
        document["reset_methods"] = list(function.reset_methods)
        document["warnings"] = _warnings(function)
    return document


NO_RESET_WARNING = (
    "no reset method: the kernel cannot reset this device between users, so the next VM may"
    " see the last one's state"
)


def _warnings(function: PciFunction) -> list[str]:
    # Bridges are never handed out, so their reset does not matter.
    if function.reset_methods == () and not function.is_bridge:
        return [NO_RESET_WARNING]
    return []


def _hex4(value: int | None) -> str | None:
    return None if value is None else f"{value:04x}"


def render_table(report: Document) -> str:
    """The report as text: a host line, a count line, one row per function by group, then the
    node labels when the report has them."""
    lines = [render_host_line(report["host"]), _summary_line(report["summary"])]
    if not report["groups"]:
        lines.append("no PCI functions found")
    else:
        lines.extend(_function_rows(report))
    if "labels" in report:
        lines.append("labels:")
        lines.extend(f"  {key}={value}" for key, value in report["labels"].items())
    return "\n".join(lines) + "\n"


def _function_rows(report: Document) -> list[str]:
    header = ("GROUP", "BDF", "ID", "DEVICE", "DRIVER", "CDEV", "NUMA", "ASSIGNABLE")
    rows: list[tuple[str, ...]] = []
    for group in report["groups"]:
        label = "-" if group["group"] is None else str(group["group"])
        for index, device in enumerate(group["functions"]):
            rows.append(
                (
                    label if index == 0 else "",
                    device["bdf"],
                    f"{device['vendor_id']}:{device['device_id']}",
                    _shorten(_display_name(device)),
                    device["driver"] or "-",
                    device["vfio_cdev"] or "-",
                    "-" if device["numa_node"] is None else str(device["numa_node"]),
                    _verdict(device)
                    + "".join(
                        f"; warning: {w.partition(':')[0]}" for w in device.get("warnings", ())
                    ),
                )
            )
        for name in group["other_members"]:
            rows.append(("", name, "", "(not a PCI function)", "", "", "", ""))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def render_host_line(host: Document) -> str:
    iommufd = "no"
    if host["iommufd"]:
        node = host["iommufd_node"] or "no /dev/iommu node"
        iommufd = f"yes ({node}{' ' + host['iommufd_devnum'] if host['iommufd_devnum'] else ''})"
    cdev = {True: "yes", False: "no (CONFIG_VFIO_DEVICE_CDEV off)", None: "unknown"}
    return (
        f"host: kernel {host['kernel'] or 'unknown'}; IOMMU {'on' if host['iommu'] else 'off'};"
        f" iommufd {iommufd}; VFIO cdevs {cdev[host['vfio_cdev']]};"
        f" legacy VFIO {'yes' if host['legacy_vfio'] else 'no'}"
    )


def _summary_line(summary: Document) -> str:
    return (
        f"{_count(summary['functions'], 'PCI function')} in"
        f" {_count(summary['groups'], 'IOMMU group')}; {summary['assignable']} assignable"
        f" ({summary['iommufd']} over iommufd, {summary['legacy']} over legacy VFIO only)"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _display_name(device: Document) -> str:
    parts = [p for p in (device["vendor"], device["device"]) if p]
    if not parts and device["class_name"]:
        parts = [device["class_name"]]
    return " ".join(parts) or "-"


def _shorten(text: str) -> str:
    return text if len(text) <= _NAME_WIDTH else text[: _NAME_WIDTH - 1] + "…"


def _verdict(device: Document) -> str:
    claim = f"; prepared for {device['prepared_for']}" if device.get("prepared_for") else ""
    if device["backend"] == "iommufd":
        return f"yes (iommufd){claim}"
    if device["backend"] == "legacy":
        return f"yes (legacy VFIO; {'; '.join(device['reasons'])}){claim}"
    return f"no: {'; '.join(device['reasons'])}{claim}"
