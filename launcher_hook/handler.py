"""OnDefineDomain as both front ends run it: detect, rewrite, log one line per VMI."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from hostdev.untrusted import quote_untrusted
from launcher_hook.capabilities import LibvirtVersionSource, read_capabilities
from launcher_hook.domain import pci_sources, rewrite_domain
from launcher_hook.model import Policy

log = logging.getLogger("launcher_hook")

_DEBUG_PAYLOAD_CHARS = 2000


@dataclass(frozen=True, slots=True)
class HookConfig:
    policy: Policy
    root: Path
    libvirt: LibvirtVersionSource
    require_cdev_node: bool = True
    """False (`--cdev-check sysfs`): a cdev in sysfs is enough, for sidecars next to this
    project's device plugin, which gives the compute container every healthy device's node."""


def define_domain(domain_xml: bytes, vmi_json: bytes, config: HookConfig) -> bytes:
    """The domain virt-launcher should define. Raises HookError for input we refuse and for a
    `require` that cannot be met."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("OnDefineDomain vmi: %s", shorten(vmi_json))
        log.debug("OnDefineDomain domain: %s", shorten(domain_xml))
    caps = read_capabilities(
        config.root,
        pci_sources(domain_xml),
        config.libvirt.read(),
        require_node=config.require_cdev_node,
    )
    result = rewrite_domain(domain_xml, vmi_json, caps, config.policy)
    log.info("%s", result.decision.summary())
    if log.isEnabledFor(logging.DEBUG):
        log.debug("OnDefineDomain result: %s", shorten(result.domain_xml))
    return result.domain_xml


def shorten(payload: bytes) -> str:
    """One quoted log line: whitespace runs collapsed, control characters escaped, cut at a
    fixed length with the real size."""
    text = " ".join(payload.decode("utf-8", "replace").split())
    return f"{quote_untrusted(text, _DEBUG_PAYLOAD_CHARS)} ({len(payload)} bytes)"
