"""The device plugin tests' kit: the whole plugin (manager, servers, hand-off) on a simulated node
against the kubelet stand-in, for tests that talk to it over real gRPC, and the fixtures those
tests share (conftest.py re-exports them)."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deviceplugin.manager import PluginManager
from deviceplugin.metrics import PluginMetrics
from hostdev.config import PluginConfig, default_config
from hostdev.iommufd_handoff import HandoffConfig, IommufdHandoff
from hostdev.labels.publisher import LabelPublisher
from hostdev.pciids import PciIds
from sim.host import SCENARIOS, BuildHost
from sim.kubelet import KubeletStandIn

H100 = "nvidia.com/GH100H100_SXM5_80GB"
IOMMUFD = "devices.kubevirt.io/iommufd"
GPUS = [
    "0000:18:00.0",
    "0000:2a:00.0",
    "0000:3a:00.0",
    "0000:5d:00.0",
    "0000:9a:00.0",
    "0000:ab:00.0",
    "0000:ba:00.0",
    "0000:db:00.0",
]
"""The H100s of the hgx-h100 scenario, in address order (the first four on NUMA node 0)."""


@dataclass
class Plugin:
    root: Path
    kubelet: KubeletStandIn
    manager: PluginManager
    handoff: IommufdHandoff
    metrics: PluginMetrics
    thread: threading.Thread

    def stop(self) -> None:
        self.manager.stop()
        self.thread.join(5)
        self.handoff.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths hold at most 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_plugin(
    build_host: BuildHost, short_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., Plugin]]:
    """A function that starts plugins; each is stopped, with its kubelet, at teardown."""
    started: list[Plugin] = []
    names = tmp_path / "pci.ids"
    names.write_text("10de  NVIDIA Corporation\n\t2330  GH100[H100 SXM5 80GB]\n")

    def start(
        scenario: str = "hgx-h100",
        config: PluginConfig | None = None,
        *,
        kubelet_first: bool = True,
        expiry_seconds: float = 15 * 60.0,
        labels: LabelPublisher | None = None,
    ) -> Plugin:
        root = build_host(SCENARIOS[scenario]())
        kubelet = KubeletStandIn(short_dir / "kubelet")
        if kubelet_first:
            kubelet.start()
        metrics = PluginMetrics()
        handoff = IommufdHandoff(
            HandoffConfig(
                socket_dir=short_dir / "fds",
                root=root,
                owner_uid=0,
                owner_gid=0,
                expiry_seconds=expiry_seconds,
            ),
            set_rlimit_mode=lambda fd: None,
        )
        metrics.watch_handoffs(handoff.stats)
        manager = PluginManager(
            config or default_config(),
            root,
            short_dir / "kubelet",
            PciIds(names),
            metrics,
            handoff,
            labels=labels,
        )
        manager.start()
        thread = threading.Thread(target=manager.run, daemon=True)
        thread.start()
        plugin = Plugin(root, kubelet, manager, handoff, metrics, thread)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.stop()
        plugin.kubelet.stop()
