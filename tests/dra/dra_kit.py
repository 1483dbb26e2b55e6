"""Shared pieces of the DRA tests: a simulated node with a claim source, and short socket dirs."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client

from dra.api import ApiError, ResourceApi
from dra.binding import OnDemandBinder
from dra.claims import ClaimRef
from dra.driver import DraDriver, DriverSettings
from dra.host_cache import HostCache
from dra.prepare import ClaimPreparer
from dra.prepare_plan import Paths
from dra.serialize_lock import SerializeLock
from dra.state import ClaimStore
from hostdev.binding.bind import HostAccess
from hostdev.config import PluginConfig, default_config
from hostdev.pciids import PciIds
from sim.dra_kubelet import DRAKubeletStandIn
from sim.kernel import KernelSimulator

DRIVER = "vfio.kubevirt-iommufd.io"
NODE = "node-a"


class Claims:
    """Claims as the API server would return them, keyed by namespace/name."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.down = False

    def add(self, ref: ClaimRef, devices: Iterable[tuple[str, str]], **metadata: Any) -> None:
        self.objects[ref.namespace, ref.name] = {
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid, **metadata},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": r, "driver": DRIVER, "pool": NODE, "device": d}
                            for r, d in devices
                        ]
                    }
                }
            },
        }

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if self.down:
            raise ApiError("get resourceclaim: API server unreachable (connection refused)")
        try:
            return self.objects[namespace, name]
        except KeyError:
            raise ApiError(f"get resourceclaim {namespace}/{name}: not found", 404) from None


class Node:
    """A simulated node's preparer; with `kernel`, one that binds devices on demand through a
    kernel simulator (and its own binding lock under the node's root)."""

    def __init__(
        self,
        root: Path,
        tmp: Path,
        config: PluginConfig | None = None,
        kernel: KernelSimulator | None = None,
    ) -> None:
        self.root = root
        self.claims = Claims()
        self.paths = Paths(tmp / "cdi", tmp / "run" / "metadata", tmp / "state" / "metadata")
        self.state_dir = tmp / "state"
        self.run_dir = tmp / "run"
        self.names = PciIds(None)
        self.config = config or default_config()
        self.kernel = kernel
        self.lock_wait = 1.0
        self.preparer = self.start()

    def binder(self) -> OnDemandBinder | None:
        if self.kernel is None:
            return None
        access = HostAccess(root=self.root, writer=self.kernel, runner=self.kernel.run)
        return OnDemandBinder(
            access, self.state_dir / "bindings", lock_wait=self.lock_wait, nodes_wait=1.0
        )

    def start(self, serialize: SerializeLock | None = None) -> ClaimPreparer:
        """A fresh preparer over the same directories, as after a restart of the driver; with
        `serialize`, held around its work as by an instance of a rolling update."""
        store = ClaimStore(self.state_dir, self.run_dir)
        store.load()
        host = HostCache(self.root, self.config, self.names)
        host.scan()
        return ClaimPreparer(
            DRIVER,
            NODE,
            self.claims,
            host,
            store,
            self.paths,
            binder=self.binder(),
            serialize=serialize,
        )


REF = ClaimRef("vms", "vm-gpus", "a1b2c3d4-0000-4000-8000-000000000001")
OTHER = ClaimRef("vms", "other", "a1b2c3d4-0000-4000-8000-000000000002")


@contextlib.contextmanager
def short_directory() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are capped at 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def driver_settings(root: Path, base: Path, rescan_interval: float) -> DriverSettings:
    """The driver on the simulated node at `root`, its kubelet, CDI, state and run directories
    under `base`."""
    return DriverSettings(
        node=NODE,
        driver=DRIVER,
        root=root,
        kubelet_dir=base / "kubelet",
        cdi_dir=base / "cdi",
        state_dir=base / "state",
        run_dir=base / "run",
        rescan_interval=rescan_interval,
    )


@contextlib.contextmanager
def running_driver(
    root: Path, base: Path, api_client: kubernetes.client.ApiClient, config: PluginConfig
) -> Iterator[tuple[DriverSettings, DRAKubeletStandIn]]:
    """The whole driver on the node at `root` (directories under `base`), registered with a
    kubelet stand-in."""
    settings = driver_settings(root, base, 0.2)
    driver = DraDriver(settings, config, PciIds(None), ResourceApi(api_client))
    driver.start()
    try:
        with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
            kubelet.wait_registered(DRIVER)
            yield settings, kubelet
    finally:
        driver.stop()
