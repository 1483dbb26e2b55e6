"""Detection: what the node's kernel, each requested device and libvirt offer. All IO is here.

Only the domain's PCI host devices are read (`hostdev.scan.read_functions`, with one pass over
the host-wide listings), at each OnDefineDomain: a full `hostdev.scan_host` costs ~130 ms on a
4,096-function node, and the devices' cdevs are what matters at the moment the domain is
defined, not when the sidecar started. Paths are joined under `root` (`/` in a pod, a fixture
tree in tests). A cdev is `sys/bus/pci/devices/<BDF>/vfio-dev/vfioN` with a `dev` file, and its
`/dev/vfio/devices/vfioN`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.errors import HostdevError
from hostdev.model import PciFunction, is_vfio_driver
from hostdev.scan import read_functions
from launcher_hook.model import Capabilities, DeviceSupport, LibvirtVersion, Sourced

log = logging.getLogger(__name__)


def read_capabilities(
    root: Path,
    bdfs: Iterable[Bdf],
    libvirt: Sourced[LibvirtVersion] | None,
    *,
    require_node: bool = True,
) -> Capabilities:
    wanted = list(bdfs)
    try:
        # A domain without PCI host devices needs no look at the host's device listings.
        functions = read_functions(root, wanted) if wanted else {}
    except HostdevError as error:
        # Unreadable sysfs means unknown, and unknown means legacy, never a broken domain.
        return Capabilities(
            kernel_iommufd=read_kernel_iommufd(root),
            devices={bdf: DeviceSupport(None, str(error)) for bdf in wanted},
            libvirt=libvirt,
        )
    return Capabilities(
        kernel_iommufd=read_kernel_iommufd(root),
        devices={
            bdf: device_support(bdf, function, require_node=require_node)
            for bdf, function in functions.items()
        },
        libvirt=libvirt,
    )


def read_kernel_iommufd(root: Path) -> bool:
    """CONFIG_IOMMUFD: `/dev/iommu`, or its misc class entry when the node was not made."""
    return (root / "dev/iommu").exists() or (root / "sys/class/misc/iommu").exists()


def read_device_support(root: Path, bdf: Bdf, *, require_node: bool = True) -> DeviceSupport:
    """The device's cdev. With `require_node` its /dev node must exist under `root` too; without,
    the kernel's sysfs entry is enough - for a sidecar, whose /dev never shows the nodes the
    device plugin gave the compute container."""
    return read_capabilities(root, [bdf], None, require_node=require_node).devices[bdf]


def device_support(
    bdf: Bdf, function: PciFunction | None, *, require_node: bool = True
) -> DeviceSupport:
    """Whether the function, as read, offers a cdev (see `read_device_support`)."""
    if function is None:
        return DeviceSupport(None, f"no PCI function {bdf} on this node")
    if function.vfio_cdev is None:
        return DeviceSupport(None, _why_no_cdev(function))
    if require_node and not function.vfio_cdev_present:
        return DeviceSupport(None, f"no VFIO cdev node: {function.cdev_path} is missing")
    return DeviceSupport(function.vfio_cdev, None)


def _why_no_cdev(function: PciFunction) -> str:
    if function.vfio_sysfs_without_cdev:
        return "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV"
    if not is_vfio_driver(function.driver):
        return f"no VFIO cdev: bound to {function.driver or 'no driver'}, not to a VFIO driver"
    return "no VFIO cdev: the kernel gave the device none (needs Linux >= 6.6)"


class LibvirtVersionSource:
    """libvirt's own answer once it gives one (kept: a pod's libvirt does not change), else the
    version named on the command line, else None."""

    def __init__(self, uri: str | None, flag: LibvirtVersion | None) -> None:
        self._uri = uri
        self._flag = None if flag is None else Sourced(flag, "--libvirt-version")
        self._answer: Sourced[LibvirtVersion] | None = None
        self._lock = threading.Lock()

    def read(self) -> Sourced[LibvirtVersion] | None:
        with self._lock:
            if self._answer is None and self._uri is not None:
                version = read_libvirt_version(self._uri)
                if version is not None:
                    self._answer = Sourced(version, f"libvirt at {self._uri}")
            return self._answer or self._flag


def read_libvirt_version(uri: str) -> LibvirtVersion | None:
    """`virConnectGetLibVersion` over a read-only connection; None when libvirt does not answer."""
    import libvirt

    # libvirt's default handler prints every failed connect to stderr; one DEBUG line will do.
    libvirt.registerErrorHandler(lambda _context, _error: None, None)
    try:
        connection = libvirt.openReadOnly(uri)
        try:
            number: int = connection.getLibVersion()
        finally:
            connection.close()
    except libvirt.libvirtError as error:
        log.debug("libvirt at %s did not answer: %s", uri, error)
        return None
    return LibvirtVersion.from_number(number)
