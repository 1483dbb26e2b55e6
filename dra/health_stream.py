"""The driver's device health, handed to every kubelet health stream (KEP-4680) that is open.

`HealthStreams.update` takes the driver's complete list and returns at once: it is called from the
thread that also publishes the slices, so it never waits for a watcher. Call it after every check,
changed or not: the kubelet stamps each device with the time the list arrived and reads it as
Unknown once `timeout_seconds` pass without another (pkg/kubelet/cm/dra/healthinfo.go), and
nothing here re-sends an old list on its own, which would hide a driver that stopped checking.

Each watcher has one slot holding the newest list it has not sent yet; a slow watcher skips the
lists that came in between and always ends with the latest. A watcher gets the current list as
soon as it opens (once the driver has judged its devices at all), then every later one, until its
stream ends — cancelled by the kubelet or closed by `close` at driver stop.

Each open stream holds one of the DRA socket's gRPC worker threads for as long as it lasts
(hostdev.grpc_socket, 8 workers), so at most `MAX_WATCHERS` may be open at once and more are
refused: the rest of the workers stay free for NodePrepareResources and NodeUnprepareResources.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dra.health import DeviceHealth

# The kubelet opens one stream per registration: one, two while an upgrade runs the old and the
# new instance side by side (each instance serves its own), a third across a kubelet restart
# whose old connection is not yet torn down; one more for a person's debugging client. Half the
# socket's 8 workers, so prepare and unprepare always have 4.
MAX_WATCHERS = 4
# The kubelet's limit (dra-health api.proto); it cuts a longer message to 1021 + "...".
MESSAGE_LIMIT = 1024
_ELLIPSIS = "..."


class TooManyWatchers(Exception):
    """Every stream slot is taken; the caller refuses the new stream."""


def build_message(message: str) -> str:
    """`message` as the kubelet would keep it: at most 1024 bytes of UTF-8 (so at most 1024
    characters too), a longer one cut to 1021 and "..." appended, never inside a character. A
    character the wire cannot carry (a lone surrogate from a non-UTF-8 sysfs name) is escaped."""
    encoded = message.encode("utf-8", "backslashreplace")
    if len(encoded) <= MESSAGE_LIMIT:
        return encoded.decode("utf-8")
    kept = encoded[: MESSAGE_LIMIT - len(_ELLIPSIS)].decode("utf-8", "ignore")
    return kept + _ELLIPSIS


class HealthWatch:
    """One stream's slot: the newest list not yet sent, and whether the stream is over."""

    def __init__(self, first: tuple[DeviceHealth, ...] | None) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._pending = first
        self._ended = False

    def offer(self, devices: tuple[DeviceHealth, ...]) -> None:
        """Replace whatever is pending: only the newest list matters."""
        with self._changed:
            self._pending = devices
            self._changed.notify()

    def end(self) -> None:
        """Wake the stream's thread so that it returns; safe to call more than once."""
        with self._changed:
            self._ended = True
            self._changed.notify()

    def next(self) -> tuple[DeviceHealth, ...] | None:
        """Block until there is a list to send (taken from the slot), or None once ended."""
        with self._changed:
            while self._pending is None and not self._ended:
                self._changed.wait()
            if self._ended:
                return None
            devices, self._pending = self._pending, None
            return devices


class HealthStreams:
    """The driver's one pool of devices (named after the node) and what the streams carry."""

    def __init__(self, pool: str, timeout_seconds: int, max_watchers: int = MAX_WATCHERS) -> None:
        self.pool = pool
        self.timeout_seconds = timeout_seconds
        """Sent with every device: how long the kubelet waits for news before it says Unknown."""
        self._max_watchers = max_watchers
        self._lock = threading.Lock()
        self._latest: tuple[DeviceHealth, ...] | None = None
        self._watches: set[HealthWatch] = set()
        self._closed = False

    def update(self, devices: Sequence[DeviceHealth]) -> None:
        """The complete list, now: every watcher's slot gets it (microseconds; never blocks)."""
        latest = tuple(devices)
        with self._lock:
            self._latest = latest
            watches = list(self._watches)
        for watch in watches:
            watch.offer(latest)

    def open(self) -> HealthWatch:
        """A slot for a new stream, holding the current list; TooManyWatchers when all are
        taken. Closed streams get a slot that has already ended."""
        with self._lock:
            if len(self._watches) >= self._max_watchers:
                raise TooManyWatchers(
                    f"{len(self._watches)} health streams are open already, the most this "
                    "driver serves at once; close one (a stale kubelet connection ends by itself)"
                )
            watch = HealthWatch(self._latest)
            if self._closed:
                watch.end()
            else:
                self._watches.add(watch)
        return watch

    def release(self, watch: HealthWatch) -> None:
        """The stream is over: free its slot."""
        watch.end()
        with self._lock:
            self._watches.discard(watch)

    def close(self) -> None:
        """End every stream (each returns cleanly) and refuse to keep new ones open."""
        with self._lock:
            self._closed = True
            watches, self._watches = list(self._watches), set()
        for watch in watches:
            watch.end()

    @property
    def watchers(self) -> int:
        """How many streams are open now."""
        with self._lock:
            return len(self._watches)

    @property
    def latest(self) -> tuple[DeviceHealth, ...] | None:
        """The last complete list given to `update`; None before the first."""
        with self._lock:
            return self._latest
