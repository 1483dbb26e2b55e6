"""The running DRA driver: the host's devices, the slices that publish them, the kubelet's sockets
and the preparer behind them, started and stopped together.

The host is read once at start, re-read every `rescan_interval` seconds, and the claimed
functions are read again whenever a claim is prepared, so a claim never gets a device on the
strength of an old reading.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dra.api import ResourceApi
from dra.devices import DraDevice, build_devices, judge_function
from dra.kubelet_sockets import KubeletSockets
from dra.prepare import ClaimPreparer, Paths
from dra.publisher import SlicePublisher
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra.state import ClaimStore
from hostdev.bdf import Bdf
from hostdev.config import PluginConfig
from hostdev.errors import HostdevError
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import refresh_host, scan_host

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverSettings:
    node: str
    driver: str
    root: Path
    kubelet_dir: Path
    cdi_dir: Path
    state_dir: Path
    rescan_interval: float = 5.0


class DraDriver:
    def __init__(
        self, settings: DriverSettings, config: PluginConfig, names: PciIds, api: ResourceApi
    ) -> None:
        self.settings = settings
        self._config = config
        self._names = names
        self._host_lock = threading.Lock()
        self._inventory = scan_host(settings.root)
        self.store = ClaimStore(settings.state_dir)
        self.store.load()
        self.preparer = ClaimPreparer(
            settings.driver,
            settings.node,
            api,
            self._judge,
            self.store,
            Paths(settings.cdi_dir, settings.state_dir / "metadata"),
        )
        self.publisher = SlicePublisher(
            api, settings.node, settings.driver, self._devices(self._inventory)
        )
        self.sockets = KubeletSockets(
            settings.kubelet_dir,
            settings.driver,
            DraServicerV1(self.preparer),
            DraServicerV1beta1(self.preparer),
        )
        self._stop = threading.Event()
        self._rescanner = threading.Thread(target=self._rescan_loop, name="dra-rescan", daemon=True)

    @property
    def devices(self) -> tuple[DraDevice, ...]:
        with self._host_lock:
            return self._devices(self._inventory)

    def start(self) -> None:
        """Serve the kubelet first (GetInfo must answer at once), then publish in the background."""
        self.sockets.start()
        self.publisher.start()
        self._rescanner.start()
        log.info(
            "driver %s serving on %s for node %s (%d devices, %d prepared claims)",
            self.settings.driver,
            self.settings.kubelet_dir,
            self.settings.node,
            len(self.devices),
            sum(1 for _ in self.store),
        )

    def stop(self) -> None:
        self._stop.set()
        self.sockets.stop()
        self.publisher.stop()
        if self._rescanner.is_alive():
            self._rescanner.join()

    def rescan(self) -> None:
        """Read the whole host again and publish what changed."""
        inventory = scan_host(self.settings.root)
        with self._host_lock:
            self._inventory = inventory
        self.publisher.update(self._devices(inventory))

    def _devices(self, inventory: HostInventory) -> tuple[DraDevice, ...]:
        return build_devices(inventory, self._config, self._names)

    def _judge(self, bdfs: Iterable[Bdf]) -> Mapping[Bdf, DraDevice | str]:
        wanted = set(bdfs)
        with self._host_lock:
            previous = self._inventory
            # The whole group of each function: a member bound elsewhere makes it not viable.
            changed = set(wanted)
            for bdf in wanted:
                function = previous.function(bdf)
                group = previous.group_of(function) if function else None
                changed |= {m.bdf for m in group.members if m.bdf} if group else set()
            inventory = refresh_host(self.settings.root, previous, changed)
            self._inventory = inventory
        judged: dict[Bdf, DraDevice | str] = {}
        for bdf in wanted:
            function = inventory.function(bdf)
            judged[bdf] = (
                "gone from the host"
                if function is None
                else judge_function(function, inventory, self._config, self._names)
            )
        return judged

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self.settings.rescan_interval):
            try:
                self.rescan()
            except HostdevError as error:
                log.error("re-scan failed: %s", error)
