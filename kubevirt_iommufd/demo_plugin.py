"""The real device plugin for the demo, against the kubelet stand-in, with the fd hand-off owned
by the demo's own user (the launcher's 107 needs root)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from deviceplugin.manager import PluginManager
from deviceplugin.metrics import PluginMetrics
from hostdev.config import IommufdConfig, default_config
from hostdev.iommufd_handoff import HandoffConfig, IommufdHandoff
from hostdev.pciids import PciIds
from sim.kubelet import KubeletStandIn


@contextmanager
def running_plugin(
    root: Path, work: Path, names: PciIds
) -> Iterator[tuple[KubeletStandIn, IommufdHandoff]]:
    """The plugin serving the node at `root`, registered with a kubelet stand-in under `work`."""
    kubelet = KubeletStandIn(work / "kubelet")
    kubelet.start()
    socket_dir = work / "fds"
    config = replace(
        default_config(),
        # As the shipped manifests: a node without /dev/iommu keeps the slots allocatable.
        iommufd=IommufdConfig(
            socket_dir=socket_dir,
            socket_uid=os.getuid(),
            socket_gid=os.getgid(),
            without_iommu_legacy=True,
        ),
    )
    handoff = IommufdHandoff(
        HandoffConfig(
            socket_dir=socket_dir, root=root, owner_uid=os.getuid(), owner_gid=os.getgid()
        )
    )
    manager = PluginManager(config, root, kubelet.directory, names, PluginMetrics(), handoff)
    manager.start()
    thread = threading.Thread(target=manager.run, name="demo-plugin", daemon=True)
    thread.start()
    try:
        yield kubelet, handoff
    finally:
        manager.stop()
        handoff.close()
        kubelet.stop()


def registered_resources(kubelet: KubeletStandIn) -> list[str]:
    """The resources the plugin registered that have sent their devices."""
    return sorted({r.request.resource_name for r in kubelet.registrations if r.snapshots})
