"""Plain data and decisions of the DRA kubelet stand-in (`sim.dra_kubelet`): what it records,
what its calls answer (values, so tests can compare v1 and v1beta1 answers), which services the
kubelet speaks, what it knows of device health, and `scan_registry`, its one directory read:
which sockets the kubelet counts."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

Identity = tuple[int, int, int]  # st_dev, st_ino, st_ctime_ns of a registration socket


class Claim(NamedTuple):
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None  # v1 only, and only when the plugin set it


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...]
    error: str = ""


@dataclass(frozen=True)
class Registration:
    driver: str
    endpoint: str
    socket_path: Path
    supported_versions: tuple[str, ...]
    service: str  # the chosen one, e.g. "v1.DRAPlugin"
    at: float  # time.monotonic()
    health_service: str | None = None  # the one watched, e.g. "v1.DRAResourceHealth"

    @property
    def version(self) -> str:
        return self.service.split(".", 1)[0]


@dataclass(frozen=True)
class Refusal:
    socket_path: Path
    plugin_type: str
    name: str
    error: str
    at: float


@dataclass(frozen=True)
class Deregistration:
    registration: Registration
    reason: str
    at: float


def scan_registry(directory: Path) -> dict[Path, Identity]:
    """Every registration socket below `directory`, as the plugin watcher would see it."""
    found: dict[Path, Identity] = {}
    for parent, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(parent, name)
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return found


def choose_service(offered: Iterable[str], spoken: Iterable[str]) -> str:
    """The plugin's first service the kubelet speaks; ValueError (the kubelet's refusal) if none."""
    offered, spoken = list(offered), list(spoken)
    if not offered:
        raise ValueError("empty list of supported gRPC services (aka supported versions)")
    for service in offered:
        if service in spoken:
            return service
    raise ValueError(
        f"none of services supported by the plugin ({offered}) "
        f"are supported by the kubelet ({spoken})"
    )


def pick_health_service(offered: Iterable[str], spoken: Iterable[str]) -> str | None:
    """The newest health service (in the kubelet's order of preference, `spoken`) that the
    plugin lists anywhere in its supported versions; None: the kubelet watches no health."""
    offered = set(offered)
    return next((service for service in spoken if service in offered), None)


# pkg/kubelet/cm/dra/healthinfo.go: the default when a device names no timeout of its own.
DEFAULT_HEALTH_TIMEOUT = 30.0
# The kubelet's limit on a device's message (dra-health api.proto).
HEALTH_MESSAGE_LIMIT = 1024
HEALTH_NAMES = {0: "Unknown", 1: "Healthy", 2: "Unhealthy"}


@dataclass(frozen=True)
class SeenHealth:
    """One device's health as the kubelet holds it (state.DeviceHealth)."""

    pool: str
    device: str
    health: str  # "Healthy", "Unhealthy" or "Unknown", as in the kubelet's state
    message: str
    last_updated_time: int  # as the plugin sent it (Unix seconds); the kubelet ignores it
    timeout: float  # seconds without news after which the kubelet says Unknown
    received: float  # time.monotonic() when the kubelet last heard of it: its LastUpdated

    def at(self, now: float) -> SeenHealth:
        """As the kubelet reads it at `now`: Unknown once the timeout passed without news."""
        if self.health == "Unknown" or now - self.received <= self.timeout:
            return self
        return replace(self, health="Unknown")


def read_health_response(response: Any, now: float) -> dict[str, SeenHealth]:
    """A NodeWatchResourcesResponse (any version) as the kubelet reads it, keyed like its cache
    ("<pool>/<device>"): a longer message cut to 1021 characters and "...", a timeout of zero or
    less meaning the default."""
    seen: dict[str, SeenHealth] = {}
    for device in response.devices:
        message = device.message
        if len(message) > HEALTH_MESSAGE_LIMIT:
            message = message[: HEALTH_MESSAGE_LIMIT - 3] + "..."
        timeout = device.health_check_timeout_seconds
        seen[f"{device.device.pool_name}/{device.device.device_name}"] = SeenHealth(
            pool=device.device.pool_name,
            device=device.device.device_name,
            health=HEALTH_NAMES.get(device.health, "Unknown"),
            message=message,
            last_updated_time=device.last_updated_time,
            timeout=float(timeout) if timeout > 0 else DEFAULT_HEALTH_TIMEOUT,
            received=now,
        )
    return seen


def reconcile_health(
    known: dict[str, SeenHealth], reported: dict[str, SeenHealth], now: float
) -> dict[str, SeenHealth]:
    """healthinfo.go updateHealthInfo: every reported device as reported; a known one the report
    leaves out becomes Unknown once its timeout has passed, and is kept until then."""
    merged = dict(reported)
    for key, device in known.items():
        if key not in reported:
            merged[key] = device.at(now)
    return merged


def read_prepare_response(response: Any, *, with_share_id: bool) -> dict[str, PrepareResult]:
    return {
        uid: PrepareResult(
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if with_share_id and d.HasField("share_id") else None,
                )
                for d in result.devices
            ),
            error=result.error,
        )
        for uid, result in response.claims.items()
    }
