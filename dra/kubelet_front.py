"""What the kubelet talks to, served before the rest of the driver is loaded: the registration
and DRA sockets (dra.kubelet_sockets), the health streams, and the gate that NodePrepare and
NodeUnprepare wait at until the driver has recovered and read the host.

The kubelet sees the driver (its plugin watcher calls GetInfo) as soon as the sockets are served,
from grpc and the protocol stubs alone: nothing here imports the preparer, the host scan or the
API client, which load afterwards. A claim prepared before recovery finished could be given a
device an interrupted bind still holds, so the calls wait — at most `READY_WAIT_SECONDS`, under
the kubelet's 45 s deadline, so that it hears why from a start slower than that (and retries),
and a start that failed answers them with its error at once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dra.claims import ClaimRef
from dra.health_stream import HealthStreams
from dra.kubelet_sockets import KubeletSockets
from dra.servicer import DraServicerV1, DraServicerV1beta1, Preparer

if TYPE_CHECKING:
    from dra.state import PreparedClaim

READY_WAIT_SECONDS = 40.0


class PreparerWhenReady:
    """Hands the kubelet's calls to the preparer once `ready` gave it; until then they wait."""

    def __init__(self, wait_seconds: float = READY_WAIT_SECONDS) -> None:
        self._wait_seconds = wait_seconds
        self._settled = threading.Event()
        self._settling = threading.Lock()
        self._preparer: Preparer | None = None
        self._failure = ""

    def ready(self, preparer: Preparer) -> None:
        """Recovery is done: let the calls through, the waiting ones first. Once `failed`, the
        calls keep their answer."""
        with self._settling:
            if not self._settled.is_set():
                self._preparer = preparer
                self._settled.set()

    def failed(self, reason: str) -> None:
        """The start failed (the driver stops): the waiting calls, and any later, get `reason`.
        Once `ready`, the calls keep going to the preparer until the sockets go."""
        with self._settling:
            if not self._settled.is_set():
                self._failure = reason
                self._settled.set()

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        preparer = self._wait()
        if isinstance(preparer, str):
            return {ref.uid: f"{ref}: {preparer}" for ref in refs}
        return preparer.prepare(refs)

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        preparer = self._wait()
        if isinstance(preparer, str):
            return {ref.uid: f"{ref}: cannot clean up: {preparer}" for ref in refs}
        return preparer.unprepare(refs)

    def _wait(self) -> Preparer | str:
        """The preparer, or why there is none."""
        if not self._settled.wait(self._wait_seconds):
            return (
                f"the driver is still starting after {self._wait_seconds:g} s (recovering the"
                " prepared claims and reading the host); the kubelet retries"
            )
        if self._preparer is None:
            return (
                f"the driver failed to start: {self._failure}; it stops, and its pod is"
                " restarted (see its log)"
            )
        return self._preparer


@dataclass(frozen=True, slots=True)
class KubeletFront:
    gate: PreparerWhenReady
    health: HealthStreams
    sockets: KubeletSockets


def build_kubelet_front(
    kubelet_dir: Path,
    driver: str,
    node: str,
    rescan_interval: float,
    instance_uid: str = "",
    *,
    ready_wait_seconds: float = READY_WAIT_SECONDS,
) -> KubeletFront:
    """The sockets (not served yet), their health streams and the gate before the preparer."""
    gate = PreparerWhenReady(ready_wait_seconds)
    # Events re-judge a device at once, but the periodic re-scan is the one check that always
    # comes: three re-scans missed (a stuck event thread) is when the kubelet should stop
    # believing us, and never sooner than its own 30 s default.
    health = HealthStreams(node, timeout_seconds=max(30, math.ceil(3 * rescan_interval)))
    sockets = KubeletSockets(
        kubelet_dir,
        driver,
        DraServicerV1(gate),
        DraServicerV1beta1(gate),
        health,
        instance_uid=instance_uid,
    )
    return KubeletFront(gate, health, sockets)
