"""The real launcher hook for the demo: served on its gRPC socket as a KubeVirt sidecar, asked
Info and OnDefineDomain as virt-launcher asks, and what it changed shown as a diff."""

from __future__ import annotations

import difflib
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from lxml import etree

from launcher_hook.capabilities import LibvirtVersionSource
from launcher_hook.domain import DECISION_NS
from launcher_hook.handler import HookConfig, define_domain
from launcher_hook.hooks.info import api_pb2 as info_pb2
from launcher_hook.hooks.info import api_pb2_grpc as info_grpc
from launcher_hook.hooks.v1alpha3 import api_pb2 as hooks_pb2
from launcher_hook.hooks.v1alpha3 import api_pb2_grpc as hooks_grpc
from launcher_hook.model import LibvirtVersion, Policy
from launcher_hook.server import HookServer


@dataclass(frozen=True, slots=True)
class HookAnswer:
    info: str
    """What Info said: name, versions, hook points."""
    domain: bytes
    """The domain OnDefineDomain returned."""


@dataclass(frozen=True, slots=True)
class HostdevDecision:
    alias: str
    bdf: str
    backend: str
    reason: str


def ask_hook(socket_path: Path, root: Path, libvirt: str, domain: str, vmi: str) -> HookAnswer:
    """Serve the hook for a node at `root` and a launcher with `libvirt`, and have it rewrite
    `domain` for `vmi` (JSON) over its socket, as virt-launcher does."""
    config = HookConfig(
        policy=Policy.AUTO,
        root=root,
        libvirt=LibvirtVersionSource(None, LibvirtVersion.parse(libvirt, "demo")),
    )
    server = HookServer(socket_path, "iommufd", lambda d, v: define_domain(d, v, config))
    server.start()
    waiter = threading.Thread(target=server.wait, daemon=True)
    waiter.start()
    try:
        with grpc.insecure_channel(f"unix://{server.socket_path}") as channel:
            info = info_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=5)
            callbacks = hooks_grpc.CallbacksStub(channel)
            result = callbacks.OnDefineDomain(
                hooks_pb2.OnDefineDomainParams(domainXML=domain.encode(), vmi=vmi.encode()),
                timeout=10,
            )
            callbacks.Shutdown(hooks_pb2.ShutdownParams(), timeout=5)
    finally:
        server.stop()
        waiter.join(5)
    shown = (
        f"Info -> name {info.name}, versions {', '.join(info.versions)}, hook points "
        + ", ".join(p.name for p in info.hookPoints)
    )
    return HookAnswer(shown, result.domainXML)


def domain_diff(before: bytes, after: bytes) -> str:
    """What the hook changed; both through one serializer, so the diff shows changes, not
    lxml's spelling."""
    old = etree.tostring(etree.fromstring(before)).decode()
    new = etree.tostring(etree.fromstring(after)).decode()
    diff = difflib.unified_diff(
        old.splitlines(),
        new.splitlines(),
        "domain.xml (KubeVirt)",
        "domain.xml (hook)",
        lineterm="",
        n=1,
    )
    return "\n".join(diff) or "(no change)"


def read_decisions(domain: bytes) -> list[HostdevDecision]:
    """The hook's record in the domain's <metadata>: per PCI hostdev, its backend and why."""
    return [
        HostdevDecision(
            e.get("alias", ""), e.get("bdf", ""), e.get("backend", ""), e.get("reason", "")
        )
        for e in etree.fromstring(domain).findall(f".//{{{DECISION_NS}}}hostdev")
    ]
