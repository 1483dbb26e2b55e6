"""Resource and environment names, byte-identical to the ones users already have in their VMIs.

NVIDIA's kubevirt-gpu-device-plugin names a resource `nvidia.com/<pci.ids device name>` with the
name upper-cased, `/` and `.` made `_`, runs of ASCII white space made `_`, and every character
other than ASCII letters, digits and `_` dropped; a device id missing from pci.ids is used as is
(`nvidia.com/2330`). Matching that exactly lets users switch plugins without editing a VMI.
"""

from __future__ import annotations

import functools
import re

NVIDIA_DOMAIN = "nvidia.com"
# Go's regexp `\s` is ASCII-only; Python's would also take Unicode spaces.
_GO_WHITESPACE = re.compile(r"[\t\n\f\r ]+")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_.]+")


# Pure and asked once per function of a node that holds few kinds of device: 4,096 functions
# would otherwise spend most of a re-scan upper-casing the same few names.
@functools.lru_cache(maxsize=1024)
def nvidia_device_name(pci_ids_name: str | None, device_id: int) -> str:
    """The name part of NVIDIA's resource name for a device id."""
    if not pci_ids_name or not pci_ids_name.strip():
        return f"{device_id:04x}"
    name = _go_upper(pci_ids_name.strip()).replace("/", "_").replace(".", "_")
    name = _GO_WHITESPACE.sub("_", name)
    return _NOT_NAME.sub("", name)


def _go_upper(text: str) -> str:
    # Go's strings.ToUpper maps rune by rune; Python's str.upper may grow a character ("ß" to
    # "SS"), which would then survive the filter below.
    return "".join(c.upper() if len(c.upper()) == 1 else c for c in text)


def nvidia_resource_name(pci_ids_name: str | None, device_id: int) -> str:
    return f"{NVIDIA_DOMAIN}/{nvidia_device_name(pci_ids_name, device_id)}"


def pci_resource_env(resource_name: str) -> str:
    """The variable virt-launcher reads the BDFs from: `PCI_RESOURCE_` + the resource name
    upper-cased with `/` and `.` made `_` (hyphens kept)."""
    return "PCI_RESOURCE_" + resource_name.upper().replace("/", "_").replace(".", "_")
