"""Which VFIO driver a device should get: a variant driver whose `vfio_pci:` alias matches the
device's modalias (e.g. `nvgrace_gpu_vfio_pci` on Grace), else `vfio-pci`.

Variant drivers declare the devices they take with `MODULE_DEVICE_TABLE(vfio_pci, …)`, which
depmod writes to `modules.alias` as `alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_
vfio_pci`; the pattern has the layout of the device's `pci:v…` modalias. Among several matches
the most specific (fewest `*`) wins, as libvirt and driverctl choose.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hostdev.errors import HostReadError

VFIO_PCI = "vfio-pci"
_ALIAS_PREFIX = "vfio_pci:"


@dataclass(frozen=True, slots=True)
class VfioAlias:
    """One `alias vfio_pci:<pattern> <module>` line."""

    pattern: str
    """The part after `vfio_pci:`, matched against a modalias without its `pci:`."""
    module: str


def parse_modules_alias(text: str) -> tuple[VfioAlias, ...]:
    """The `vfio_pci:` aliases of a modules.alias file; every other line is ignored."""
    aliases: list[VfioAlias] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "alias" and parts[1].startswith(_ALIAS_PREFIX):
            aliases.append(VfioAlias(parts[1].removeprefix(_ALIAS_PREFIX), parts[2]))
    return tuple(aliases)


def choose_vfio_driver(modalias: str | None, aliases: Iterable[VfioAlias]) -> str:
    """The most specific variant module matching `modalias`, or `vfio-pci` when none does
    (or when the device has no modalias)."""
    if not modalias or not modalias.startswith("pci:"):
        return VFIO_PCI
    device = modalias.removeprefix("pci:")
    matches = [a for a in aliases if fnmatch.fnmatchcase(device, a.pattern)]
    if not matches:
        return VFIO_PCI
    # Ties (two modules claiming a device equally specifically) go to the name sorting first,
    # so the answer never depends on the file's order.
    best = min(matches, key=lambda a: (a.pattern.count("*"), a.module))
    return best.module


def driver_names(name: str) -> tuple[str, ...]:
    """The spellings a driver may have: module names use `_`, some sysfs driver dirs use `-`
    (the `vfio_pci` module registers the driver `vfio-pci`)."""
    return tuple(dict.fromkeys((name, name.replace("_", "-"), name.replace("-", "_"))))


def same_driver(a: str | None, b: str | None) -> bool:
    """Whether two names denote the same driver, whichever of `-`/`_` each uses."""
    if a is None or b is None:
        return a is b
    return a.replace("-", "_") == b.replace("-", "_")


def module_name(driver: str) -> str:
    """What `modprobe` is given for a driver name."""
    return driver.replace("-", "_")


def modules_alias_path(host_root: Path, kernel_release: str) -> Path:
    return host_root / "lib/modules" / kernel_release / "modules.alias"


def read_vfio_aliases(host_root: Path, kernel_release: str) -> tuple[VfioAlias, ...]:
    """The `vfio_pci:` aliases of the running kernel's modules; none when the file is missing
    (a kernel built without modules), so every device gets vfio-pci."""
    path = modules_alias_path(host_root, kernel_release)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ()
    except OSError as error:
        raise HostReadError(
            str(path),
            error.strerror or str(error),
            "pass --host-root with the directory holding the host's /lib/modules",
        ) from error
    return parse_modules_alias(text)


def find_driver_dir(sys_root: Path, driver: str) -> str | None:
    """The name under which a driver is registered on the PCI bus, whichever spelling it uses,
    or None while it is not loaded."""
    drivers = sys_root / "sys/bus/pci/drivers"
    for name in driver_names(driver):
        if (drivers / name).is_dir():
            return name
    return None
