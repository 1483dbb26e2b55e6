"""A first look at the host: each PCI function's ids, class and driver, read from two sysfs entries
per function (its `modalias` and its `driver` link), which is all that tells which resources the
node has. The plugin registers them from this while the full scan (`hostdev.scan`, a dozen reads
per function) runs after, and judges the devices from that scan alone: a function this look
misses or misreads only moves its resource's registration after the scan.
"""

from __future__ import annotations

import os
from pathlib import Path

from hostdev.bdf import Bdf, is_bdf
from hostdev.model import PciFunction
from hostdev.scan import PCI_DEVICES, ids_from_modalias


def read_identities(root: Path) -> tuple[PciFunction, ...]:
    """The functions under `root` whose identity reads cleanly, in address order; fields a
    resource's selectors never look at are left empty."""
    # os calls through each device directory's fd, as in hostdev.scan: path walks and pathlib
    # objects would double the time per function.
    devices = str(root / PCI_DEVICES)
    try:
        names = sorted(n for n in os.listdir(devices) if is_bdf(n))  # noqa: PTH208
    except OSError:
        return ()
    found = []
    for name in names:
        try:
            fd = os.open(f"{devices}/{name}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            identity = _read_identity(fd, name)
        except OSError:
            continue
        finally:
            os.close(fd)
        if identity is not None:
            found.append(identity)
    return tuple(found)


def _read_identity(fd: int, name: str) -> PciFunction | None:
    modalias = os.open("modalias", os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
    try:
        ids = ids_from_modalias(os.read(modalias, 256).decode("ascii", "replace").strip())
    finally:
        os.close(modalias)
    if ids is None:
        return None
    try:
        driver: str | None = os.readlink("driver", dir_fd=fd).rpartition("/")[2]
    except FileNotFoundError:
        driver = None
    vendor, device, _, _, class_code = ids
    return _identity(Bdf.parse(name), vendor, device, class_code, driver)


def _identity(
    bdf: Bdf, vendor: int, device: int, class_code: int, driver: str | None
) -> PciFunction:
    return PciFunction(
        bdf=bdf,
        vendor_id=vendor,
        device_id=device,
        subsystem_vendor_id=None,
        subsystem_device_id=None,
        class_code=class_code,
        revision=None,
        driver=driver,
        iommu_group=None,
        numa_node=None,
        sriov=None,
        physfn=None,
        modalias=None,
        upstream=(),
        consumers=(),
        vfio_cdev=None,
        vfio_cdev_present=False,
        vfio_sysfs_without_cdev=False,
    )
