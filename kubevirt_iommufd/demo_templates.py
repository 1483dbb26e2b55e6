"""The demo's documents as KubeVirt makes them: the VMI, its virt-launcher pod and the domain XML
virt-launcher generates (files in `demo_data`), filled in for a resource and its devices."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from string import Template
from typing import Any

import yaml

Object = dict[str, Any]


def read_template(name: str) -> str:
    return resources.files("kubevirt_iommufd").joinpath("demo_data", name).read_text()


def build_launcher_pod(resource: str) -> Object:
    """The launcher pod of VMI demo/vmi-h100 (two `deviceName` devices of `resource`), as
    virt-controller renders it."""
    return _object(
        yaml.safe_load(Template(read_template("launcher-pod.yaml")).substitute(resource=resource))
    )


def build_vmi(resource: str) -> Object:
    """VMI demo/vmi-h100: a GPU and a host device, both `deviceName: <resource>`."""
    return _object(json.loads(Template(read_template("vmi.json")).substitute(resource=resource)))


def build_domain(bdfs: Sequence[str]) -> str:
    """The domain virt-launcher generates for the VMI with its devices at `bdfs`, in the order
    it hands them out (ua-gpu-gpu1, then ua-hostdevice-gpu2)."""
    return Template(read_template("domain.xml")).substitute(hostdevs=_hostdevs(bdfs))


def _hostdevs(bdfs: Sequence[str]) -> str:
    aliases = ["ua-gpu-gpu1", "ua-hostdevice-gpu2"]
    entries = []
    for alias, bdf in zip(aliases, bdfs, strict=False):
        domain, bus, rest = bdf.split(":")
        slot, function = rest.split(".")
        entries.append(
            '    <hostdev type="pci" managed="no" mode="subsystem">\n'
            "      <source>\n"
            f'        <address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}"'
            f' function="0x{function}"></address>\n'
            "      </source>\n"
            f'      <alias name="{alias}"></alias>\n'
            "    </hostdev>"
        )
    return "\n".join(entries)


def _object(value: object) -> Object:
    if not isinstance(value, dict):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return value
