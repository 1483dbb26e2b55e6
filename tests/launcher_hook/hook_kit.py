"""Shared pieces of the launcher hook tests: simulated nodes, libvirt validation, a hook client
that talks to a socket the way virt-launcher does, and XML canonicalisation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import libvirt
from lxml import etree

from fetch_libvirt_schemas import ensure_schemas
from launcher_hook.capabilities import read_capabilities
from launcher_hook.domain import pci_sources
from launcher_hook.hooks.info import api_pb2 as info_pb2
from launcher_hook.hooks.info import api_pb2_grpc as info_grpc
from launcher_hook.hooks.v1alpha1 import api_pb2 as v1alpha1_pb2
from launcher_hook.hooks.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from launcher_hook.hooks.v1alpha2 import api_pb2 as v1alpha2_pb2
from launcher_hook.hooks.v1alpha2 import api_pb2_grpc as v1alpha2_grpc
from launcher_hook.hooks.v1alpha3 import api_pb2 as v1alpha3_pb2
from launcher_hook.hooks.v1alpha3 import api_pb2_grpc as v1alpha3_grpc
from launcher_hook.model import Capabilities, LibvirtVersion, Sourced
from sim.host import HostSpec, build_tree, hgx_h100, sriov_nic

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
GPU1, GPU2, VF = "0000:18:00.0", "0000:2a:00.0", "0000:5e:00.2"


def read_data(name: str) -> bytes:
    return (DATA / name).read_bytes()


def vmi_json(fixture: str = "vmi-h100.json", /, **annotations: str) -> bytes:
    """A fixture VMI, with extra annotations."""
    document = json.loads(read_data(fixture))
    document["metadata"]["annotations"].update(annotations)
    return json.dumps(document).encode()


# Nodes ---------------------------------------------------------------------------------------


def gpu_node() -> HostSpec:
    """8 H100s and 4 SR-IOV VFs, all on vfio-pci, with iommufd and cdevs."""
    return HostSpec(
        hgx_h100().functions + sriov_nic().functions,
        description="H100 GPUs and ConnectX VFs on vfio-pci",
    )


def build_cdevs(root: Path) -> Path:
    return build_tree(gpu_node(), root)


def build_missing_cdev_node(root: Path) -> Path:
    """Like build_cdevs, but GPU2's /dev/vfio/devices node was not handed to the pod."""
    build_tree(gpu_node(), root)
    (cdev,) = (root / "sys/bus/pci/devices" / GPU2 / "vfio-dev").iterdir()
    (root / "dev/vfio/devices" / cdev.name).unlink()
    return root


def build_legacy_kernel(root: Path) -> Path:
    """A kernel without iommufd and VFIO cdevs (Debian bookworm's 6.1)."""
    return build_tree(replace(gpu_node(), iommufd=False, vfio_cdev=False), root)


NODES: dict[str, Callable[[Path], Path]] = {
    "cdevs": build_cdevs,
    "no-cdev-node": build_missing_cdev_node,
    "legacy-kernel": build_legacy_kernel,
}

LIBVIRT: dict[str, LibvirtVersion | None] = {
    "unknown": None,
    "11.10": LibvirtVersion(11, 10, 0),
    "12.1": LibvirtVersion(12, 1, 0),
    "12.2": LibvirtVersion(12, 2, 0),
    "12.9": LibvirtVersion(12, 9, 0),
}


def capabilities(
    root: Path, domain_xml: bytes, libvirt_version: LibvirtVersion | None
) -> Capabilities:
    flag = None if libvirt_version is None else Sourced(libvirt_version, "--libvirt-version")
    return read_capabilities(root, pci_sources(domain_xml), flag)


# XML -----------------------------------------------------------------------------------------


def canonical(xml: bytes) -> str:
    """C14N 2.0 with comments: equal strings mean equal documents."""
    text: str = etree.canonicalize(xml.decode(), with_comments=True)
    return text


def uses_iommufd_xml(xml: bytes) -> bool:
    root = etree.fromstring(xml)
    return root.find("iommufd") is not None or bool(root.xpath("devices/hostdev/driver/@iommufd"))


def schema_copy(xml: bytes) -> bytes:
    """KubeVirt writes type='pci' on a hostdev's source <address>; libvirt's parser takes it but
    its RelaxNG schema does not (FACTS.md §3). Drop it in the copy we validate, only there."""
    root = etree.fromstring(xml)
    for address in root.iterfind("devices/hostdev/source/address[@type='pci']"):
        del address.attrib["type"]
    return etree.tostring(root)


def load_domain_schema() -> etree.RelaxNG:
    """libvirt 12.9's domain grammar, fetched from Debian trixie-backports and cached; raises
    SchemaFetchError with what to do when it cannot be had (tests fail, never skip)."""
    return etree.RelaxNG(etree.parse(str(ensure_schemas() / "domain.rng")))


def schema_errors(schema: etree.RelaxNG, xml: bytes) -> str | None:
    if schema.validate(etree.fromstring(schema_copy(xml))):
        return None
    return str(schema.error_log)


def libvirt_define_errors(xml: bytes) -> str | None:
    """Define a copy on libvirt's test driver with VIR_DOMAIN_DEFINE_VALIDATE (schema + parser
    of the installed libvirt, 9.0 on bookworm); None when libvirt accepted it."""
    connection = libvirt.open("test:///default")
    libvirt.registerErrorHandler(lambda _context, _error: None, None)
    try:
        domain = connection.defineXMLFlags(
            schema_copy(xml).decode(), libvirt.VIR_DOMAIN_DEFINE_VALIDATE
        )
        domain.undefine()
    except libvirt.libvirtError as error:
        return str(error)
    finally:
        connection.close()
    return None


# A hook client, as virt-launcher is one ----------------------------------------------------

VERSIONS = ("v1alpha1", "v1alpha2", "v1alpha3")
_CALLBACKS: Mapping[str, tuple[Any, Any]] = {
    "v1alpha1": (v1alpha1_pb2, v1alpha1_grpc),
    "v1alpha2": (v1alpha2_pb2, v1alpha2_grpc),
    "v1alpha3": (v1alpha3_pb2, v1alpha3_grpc),
}


class HookClient:
    def __init__(self, socket: Path) -> None:
        self._channel = grpc.insecure_channel(f"unix:{socket}")

    def close(self) -> None:
        self._channel.close()

    def info(self, timeout: float = 1.0) -> info_pb2.InfoResult:
        stub = info_grpc.InfoStub(self._channel)
        result: info_pb2.InfoResult = stub.Info(info_pb2.InfoParams(), timeout=timeout)
        return result

    def newest_version(self) -> str:
        """virt-launcher's choice: the newest version both sides know."""
        offered = set(self.info().versions)
        return max((v for v in VERSIONS if v in offered), key=VERSIONS.index)

    def on_define_domain(self, version: str, domain_xml: bytes, vmi: bytes) -> bytes:
        pb2, grpc_module = _CALLBACKS[version]
        stub = grpc_module.CallbacksStub(self._channel)
        result = stub.OnDefineDomain(
            pb2.OnDefineDomainParams(domainXML=domain_xml, vmi=vmi), timeout=60
        )
        output: bytes = result.domainXML
        return output

    def pre_cloud_init_iso(self, version: str, source: bytes, data: bytes) -> tuple[bytes, bytes]:
        pb2, grpc_module = _CALLBACKS[version]
        stub = grpc_module.CallbacksStub(self._channel)
        result = stub.PreCloudInitIso(
            pb2.PreCloudInitIsoParams(cloudInitNoCloudSource=source, vmi=b"{}", cloudInitData=data),
            timeout=10,
        )
        return result.cloudInitNoCloudSource, result.cloudInitData

    def shutdown(self) -> None:
        stub = v1alpha3_grpc.CallbacksStub(self._channel)
        stub.Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10)


def wait_for_info(socket: Path, deadline_s: float = 10.0) -> float:
    """Poll like virt-launcher until the hook answers Info; seconds it took."""
    start = time.monotonic()
    while True:
        if socket.exists():
            client = HookClient(socket)
            try:
                client.info(timeout=0.5)
                return time.monotonic() - start
            except grpc.RpcError:
                pass
            finally:
                client.close()
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(f"no hook answered Info on {socket} within {deadline_s} s")
        time.sleep(0.005)


# The CLI as kubevirt_iommufd.cli wires it: `hook` registered on a top-level parser.
_CLI = (
    "import argparse, sys\n"
    "from launcher_hook import command\n"
    "parser = argparse.ArgumentParser(prog='kubevirt-iommufd')\n"
    "command.add_parser(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args()\n"
    "sys.exit(args.run(args))\n"
)


def hook_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", _CLI, "hook", *args]


def start_hook(*args: str, umask: int = -1) -> subprocess.Popen[bytes]:
    """The hook CLI in a child process (with `umask` set in it, unless -1)."""
    return subprocess.Popen(
        hook_argv(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, umask=umask
    )
