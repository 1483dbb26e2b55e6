"""A kubelet stand-in for DRA plugins: the plugin manager and the DRA manager, over real gRPC
on unix sockets. The demo runs the DRA driver against it; the tests do too.

Behaviours reproduced, from kubernetes/kubernetes (master, 2025):

- pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go: every unix socket below
  `<kubelet-dir>/plugins_registry/` (subdirectories too) is a registration socket, whatever its
  suffix; names starting with "." are ignored. A socket deleted and created again counts as a new
  plugin (the reconciler deregisters the old one first: reconciler/reconciler.go).
- pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go: dial the socket (blocking,
  10 s), GetInfo with a 1 s timeout, pick the handler by `type` (only "DRAPlugin" here), an
  empty `endpoint` means the registration socket itself, validate, register, then
  NotifyRegistrationStatus(true); a refusal is NotifyRegistrationStatus(false, reason).
- reconciler + goroutinemap exponential backoff: a failed or refused registration is tried again
  after 0.5 s, doubling up to 2 min 2 s.
- pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go: the chosen service is the first entry of the
  plugin's `supported_versions` that the kubelet speaks; an empty list, or one without a service
  the kubelet speaks, is refused; a second registration with the same driver and endpoint is
  refused (`add`: one instance cannot hijack another's endpoint), one with another endpoint is
  kept beside the first (two instances during a rolling update, 1.33 and later); calls go to the
  most recent registration of the driver (`get`), and to the one before once that one's
  registration socket is gone (`remove`). Only when the driver's last registration goes is its
  ResourceSlices' wipe scheduled, after `wipe_delay` (`sync`: the kubelet's is 30 s), and a
  registration before then cancels it; `wipe`, when given, does the wiping.
- pkg/kubelet/cm/dra/plugin/dra_plugin.go: NodePrepareResources/NodeUnprepareResources in the
  chosen version with a 45 s timeout.
- dra_plugin_manager.go (ResourceHealthStatus on): a registration whose `supported_versions`
  lists a health service gets NodeWatchResources in the newest one the kubelet speaks
  (pickHealthService: v1 over v1beta1 over v1alpha1; pass `health_services=("v1alpha1.
  DRAResourceHealth",)` for a 1.34-1.36 kubelet), on the DRA endpoint, for as long as it is
  registered: opened again 5 s after it ends or fails (wait.UntilWithContext), not again after
  UNIMPLEMENTED, cancelled at deregistration (sim.dra_kubelet_health).
- pkg/kubelet/cm/dra/healthinfo.go: one health cache per driver, keyed "<pool>/<device>"; each
  response stamps its devices with the time it arrived (the plugin's last_updated_time is kept
  but not used), a message over 1024 characters is cut to 1021 and "...", a timeout of zero or
  less means 30 s; a device the response leaves out, or one not heard of within its timeout,
  reads Unknown (`health(driver)`, `wait_health`).
- pkg/kubelet/pluginmanager/pluginwatcher/monitor.go (newer kubelets): GetInfo on every
  registered plugin every 10 s (10 s timeout); after 2 failures in a row the plugin is
  deregistered, and its socket, if still there, is probed at the same interval and registered
  again once it answers.
- A kubelet restart: `restart()` forgets every registration, deletes every socket file in
  plugins_registry (or the whole directory) and starts over, as the tests of issue 11 require.

Deliberate differences: the directory is polled (every 20 ms) instead of watched with inotify,
a new socket at an old path is told apart by inode and ctime; and `check_endpoint` (on by
default) refuses a plugin whose endpoint is not a socket yet, where the kubelet would accept it
and fail the first call. Pass `check_endpoint=False` for the kubelet's exact behaviour. Of two
registrations the kubelet prefers the newest whose gRPC connection is up; the stand-in does not
follow connections and takes the newest, so a test stops an instance the way a pod does
(removing its registration socket).
"""

from __future__ import annotations

import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType

import grpc

from dra.healthapi.v1 import api_pb2 as health_v1_pb2
from dra.healthapi.v1 import api_pb2_grpc as health_v1_grpc
from dra.healthapi.v1alpha1 import api_pb2 as health_v1alpha1_pb2
from dra.healthapi.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra.healthapi.v1beta1 import api_pb2 as health_v1beta1_pb2
from dra.healthapi.v1beta1 import api_pb2_grpc as health_v1beta1_grpc
from dra.pluginregistration.v1 import api_pb2 as reg_pb2
from dra.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from dra.v1 import api_pb2 as v1_pb2
from dra.v1 import api_pb2_grpc as v1_grpc
from dra.v1beta1 import api_pb2 as v1beta1_pb2
from dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from sim.dra_kubelet_health import HealthStream
from sim.dra_kubelet_records import (
    Claim,
    Deregistration,
    Identity,
    PreparedDevice,
    PrepareResult,
    Refusal,
    Registration,
    SeenHealth,
    choose_service,
    pick_health_service,
    read_health_response,
    read_prepare_response,
    reconcile_health,
    scan_registry,
)

# The records are part of this module's interface: callers import them from here.
__all__ = [
    "HEALTH_SERVICES",
    "SERVICES",
    "Claim",
    "DRAKubeletStandIn",
    "Deregistration",
    "PrepareResult",
    "PreparedDevice",
    "Refusal",
    "Registration",
    "SeenHealth",
    "choose_service",
]

PLUGIN_TYPE = "DRAPlugin"
# Service name -> (messages, stubs); the order is what a current kubelet speaks.
SERVICES: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1.DRAPlugin": (v1_pb2, v1_grpc),
    "v1beta1.DRAPlugin": (v1beta1_pb2, v1beta1_grpc),
}
# The health services, newest first: the order the kubelet prefers them in.
HEALTH_SERVICES: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1.DRAResourceHealth": (health_v1_pb2, health_v1_grpc),
    "v1beta1.DRAResourceHealth": (health_v1beta1_pb2, health_v1beta1_grpc),
    "v1alpha1.DRAResourceHealth": (health_v1alpha1_pb2, health_v1alpha1_grpc),
}


@dataclass
class _Live:
    registration: Registration
    identity: Identity
    info_channel: grpc.Channel
    dra_channel: grpc.Channel
    stop_polling: threading.Event = field(default_factory=threading.Event)
    health: HealthStream | None = None

    def close(self) -> None:
        self.stop_polling.set()
        if self.health is not None:
            self.health.stop()
        self.info_channel.close()
        self.dra_channel.close()


class _Refused(Exception):
    pass


class DRAKubeletStandIn:
    """The kubelet's side of DRA plugin registration and calls; see the module docstring."""

    def __init__(
        self,
        kubelet_dir: Path,
        *,
        services: Iterable[str] = tuple(SERVICES),
        health_services: Iterable[str] = tuple(HEALTH_SERVICES),
        health_retry: float = 5.0,
        info_poll_interval: float | None = 10.0,
        poll_timeout: float = 10.0,
        max_poll_failures: int = 2,
        check_endpoint: bool = True,
        scan_interval: float = 0.02,
        retry_initial: float = 0.5,
        retry_max: float = 122.0,
        dial_timeout: float = 10.0,
        info_timeout: float = 1.0,
        call_timeout: float = 45.0,
        wipe: Callable[[str], None] | None = None,
        wipe_delay: float = 30.0,
    ) -> None:
        self.services = tuple(services)
        unknown = [s for s in self.services if s not in SERVICES]
        if unknown:
            raise ValueError(f"unknown DRA services {unknown}; known: {list(SERVICES)}")
        self.health_services = tuple(s for s in HEALTH_SERVICES if s in set(health_services))
        unknown = sorted(set(health_services) - set(HEALTH_SERVICES))
        if unknown:
            raise ValueError(f"unknown health services {unknown}; known: {list(HEALTH_SERVICES)}")
        self.health_retry = health_retry
        self.registry_dir = kubelet_dir / "plugins_registry"
        self.info_poll_interval = info_poll_interval
        self.poll_timeout = poll_timeout
        self.max_poll_failures = max_poll_failures
        self.check_endpoint = check_endpoint
        self.scan_interval = scan_interval
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.dial_timeout = dial_timeout
        self.info_timeout = info_timeout
        self.call_timeout = call_timeout
        self.wipe = wipe
        self.wipe_delay = wipe_delay
        # History, kept across restarts, for the tests to inspect.
        self.registrations: list[Registration] = []
        self.refusals: list[Refusal] = []
        self.deregistrations: list[Deregistration] = []
        self.failures: list[str] = []  # dial or GetInfo errors before any verdict
        # (driver, "opened" / "ended" / "failed: <code>", time.monotonic()) of every stream
        self.health_events: list[tuple[str, str, float]] = []
        self._health: dict[str, dict[str, SeenHealth]] = {}  # driver -> the kubelet's cache
        self.wipes: list[str] = []  # drivers whose slices were wiped, in order
        self.restarts = 0
        self._changed = threading.Condition()
        self._generation = 0
        self._running = False
        self._scanner: threading.Thread | None = None
        self._desired: dict[Path, Identity] = {}
        self._silent: dict[Path, tuple[Identity, float]] = {}  # identity, next probe
        self._live: dict[Path, _Live] = {}
        self._pending: set[Path] = set()
        self._backoff: dict[Path, tuple[float, float]] = {}  # next attempt, last delay
        self._wipes_due: dict[str, float] = {}  # driver -> when its slices are wiped

    # Lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        with self._changed:
            self._generation += 1
            self._running = True
            generation = self._generation
        self._scanner = threading.Thread(
            target=self._scan_loop, args=(generation,), name="dra-kubelet-scan", daemon=True
        )
        self._scanner.start()

    def stop(self) -> None:
        """Stop like a killed kubelet: forget every plugin without telling it."""
        with self._changed:
            self._generation += 1
            self._running = False
            live, self._live = list(self._live.values()), {}
            self._desired, self._silent, self._backoff = {}, {}, {}
            self._wipes_due = {}
            self._changed.notify_all()
        if self._scanner is not None:
            self._scanner.join()
            self._scanner = None
        for plugin in live:
            plugin.close()

    def restart(self, *, remove_directory: bool = False, downtime: float = 0.0) -> None:
        """Stop, wipe plugins_registry (every socket in it, or the directory itself), wait
        `downtime` seconds, start again."""
        self.stop()
        if remove_directory:
            shutil.rmtree(self.registry_dir, ignore_errors=True)
        else:
            for path in scan_registry(self.registry_dir):
                path.unlink(missing_ok=True)
        time.sleep(downtime)
        with self._changed:
            self.restarts += 1
        self.start()

    def __enter__(self) -> DRAKubeletStandIn:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # What the kubelet knows --------------------------------------------------------------------
    def current(self, driver: str) -> Registration | None:
        """The registration the kubelet would call for `driver` now: its most recent live one."""
        with self._changed:
            return self._current(driver)

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Seconds until `condition` held; TimeoutError naming `what` and the history if not."""
        start = time.monotonic()
        deadline = start + timeout
        with self._changed:
            while not condition():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{what} within {timeout} s; {self._summary()}")
                self._changed.wait(min(remaining, 0.1))
        return time.monotonic() - start

    def health(self, driver: str) -> dict[str, SeenHealth]:
        """The kubelet's health cache for `driver` as it reads it now ("<pool>/<device>" ->
        health): a device not heard of within its timeout reads Unknown."""
        with self._changed:
            now = time.monotonic()
            return {key: seen.at(now) for key, seen in self._health.get(driver, {}).items()}

    def wait_health(
        self,
        driver: str,
        condition: Callable[[dict[str, SeenHealth]], bool],
        timeout: float = 5.0,
        what: str = "health",
    ) -> dict[str, SeenHealth]:
        """Wait until `condition` holds for `health(driver)` and return that map."""
        self.wait_for(lambda: condition(self.health(driver)), timeout, f"{driver}: {what}")
        return self.health(driver)

    def wait_registered(self, driver: str, timeout: float = 5.0, *, count: int = 1) -> Registration:
        """Wait until `driver` is registered now and has been registered `count` times in all
        (a restart test waits for count=2)."""

        def registered() -> bool:
            total = sum(1 for r in self.registrations if r.driver == driver)
            return total >= count and self._current(driver) is not None

        self.wait_for(registered, timeout, f"DRA driver {driver!r} not registered {count}x")
        registration = self.current(driver)
        assert registration is not None
        return registration

    def wait_refused(self, timeout: float = 5.0, *, count: int = 1) -> Refusal:
        """Wait for the `count`-th refusal and return the latest one."""
        self.wait_for(lambda: len(self.refusals) >= count, timeout, f"no {count} refusal(s)")
        return self.refusals[-1]

    def wait_deregistered(self, driver: str, timeout: float = 5.0) -> Deregistration:
        """Wait until `driver` has no live registration left after having had one."""

        def gone() -> bool:
            return self._current(driver) is None and any(
                d.registration.driver == driver for d in self.deregistrations
            )

        self.wait_for(gone, timeout, f"DRA driver {driver!r} not deregistered")
        return next(d for d in reversed(self.deregistrations) if d.registration.driver == driver)

    # Calls the kubelet makes -------------------------------------------------------------------
    def node_prepare_resources(
        self, claims: Iterable[Claim], version: str | None = None, *, driver: str | None = None
    ) -> dict[str, PrepareResult]:
        """NodePrepareResources in the negotiated version (or `version`: "v1"/"v1beta1"),
        answered as plain data keyed by claim UID. gRPC errors propagate as grpc.RpcError."""
        service, channel = self._target(driver, version)
        messages, stubs = SERVICES[service]
        request = messages.NodePrepareResourcesRequest(
            claims=[messages.Claim(namespace=c[0], uid=c[1], name=c[2]) for c in claims]
        )
        response = stubs.DRAPluginStub(channel).NodePrepareResources(
            request, timeout=self.call_timeout
        )
        return read_prepare_response(response, with_share_id=service == "v1.DRAPlugin")

    def node_unprepare_resources(
        self, claims: Iterable[Claim], version: str | None = None, *, driver: str | None = None
    ) -> dict[str, str]:
        """NodeUnprepareResources; claim UID -> error ("" when unprepared)."""
        service, channel = self._target(driver, version)
        messages, stubs = SERVICES[service]
        request = messages.NodeUnprepareResourcesRequest(
            claims=[messages.Claim(namespace=c[0], uid=c[1], name=c[2]) for c in claims]
        )
        response = stubs.DRAPluginStub(channel).NodeUnprepareResources(
            request, timeout=self.call_timeout
        )
        return {uid: result.error for uid, result in response.claims.items()}

    def _target(self, driver: str | None, version: str | None) -> tuple[str, grpc.Channel]:
        with self._changed:
            drivers = sorted({p.registration.driver for p in self._live.values()})
            if driver is None:
                if len(drivers) != 1:
                    raise LookupError(f"name the driver: registered DRA drivers are {drivers}")
                driver = drivers[0]
            registration = self._current(driver)
            if registration is None:
                raise LookupError(f"DRA driver {driver!r} is not registered (have {drivers})")
            channel = self._live[registration.socket_path].dra_channel
        if version is None:
            return registration.service, channel
        service = f"{version}.DRAPlugin"
        if service not in SERVICES:
            raise ValueError(f"unknown DRA version {version!r}; use one of {list(SERVICES)}")
        return service, channel

    # Internals (hold self._changed unless said otherwise) --------------------------------------
    def _current(self, driver: str) -> Registration | None:
        mine = [p.registration for p in self._live.values() if p.registration.driver == driver]
        return max(mine, key=lambda r: r.at) if mine else None

    def _summary(self) -> str:
        live = [f"{r.driver}@{r.endpoint} ({r.service})" for r in self._registrations_live()]
        refused = [f"{r.socket_path.name}: {r.error}" for r in self.refusals[-3:]]
        return (
            f"live: {live or 'none'}; refusals: {refused or 'none'}; "
            f"errors: {self.failures[-3:] or 'none'}; directory: {self.registry_dir}"
        )

    def _registrations_live(self) -> list[Registration]:
        return [p.registration for p in self._live.values()]

    def _deregister(self, path: Path, reason: str) -> _Live:
        plugin = self._live.pop(path)
        self.deregistrations.append(Deregistration(plugin.registration, reason, time.monotonic()))
        driver = plugin.registration.driver
        if self._current(driver) is None:
            self._wipes_due.setdefault(driver, time.monotonic() + self.wipe_delay)
        self._changed.notify_all()
        return plugin

    def _due_wipes(self, now: float) -> list[str]:
        due = [d for d, at in self._wipes_due.items() if at <= now]
        for driver in due:
            del self._wipes_due[driver]
            self.wipes.append(driver)
        return due

    def _scan_loop(self, generation: int) -> None:
        """The plugin watcher and the reconciler: runs without the lock held between passes."""
        while True:
            found = scan_registry(self.registry_dir)
            closing: list[_Live] = []
            with self._changed:
                if generation != self._generation:
                    return
                closing = self._reconcile(found, generation)
                wiping = self._due_wipes(time.monotonic())
            for plugin in closing:
                plugin.close()
            if self.wipe is not None:
                for driver in wiping:
                    self.wipe(driver)
            time.sleep(self.scan_interval)

    def _reconcile(self, found: dict[Path, Identity], generation: int) -> list[_Live]:
        now = time.monotonic()
        for path in [p for p in self._desired if p not in found]:
            del self._desired[path]
            self._backoff.pop(path, None)
        for path in [p for p in self._silent if p not in found]:
            del self._silent[path]
        for path, identity in found.items():
            silent = self._silent.get(path)
            if silent is not None and silent[0] == identity:
                continue
            self._silent.pop(path, None)
            if self._desired.get(path) != identity:
                self._desired[path] = identity
                self._backoff.pop(path, None)
        closing = [
            self._deregister(path, reason)
            for path, plugin in list(self._live.items())
            if (reason := self._stale(path, plugin))
        ]
        for path, identity in self._desired.items():
            due = self._backoff.get(path, (now, 0.0))[0] <= now
            if path not in self._live and path not in self._pending and due:
                self._pending.add(path)
                threading.Thread(
                    target=self._register,
                    args=(path, identity, generation),
                    name="dra-kubelet-register",
                    daemon=True,
                ).start()
        for path, (identity, next_probe) in list(self._silent.items()):
            if next_probe <= now and path not in self._pending:
                self._pending.add(path)
                threading.Thread(
                    target=self._probe,
                    args=(path, identity, generation),
                    name="dra-kubelet-probe",
                    daemon=True,
                ).start()
        return closing

    def _stale(self, path: Path, plugin: _Live) -> str:
        identity = self._desired.get(path)
        if identity is None:
            return "registration socket removed"
        if identity != plugin.identity:
            return "registration socket replaced"
        return ""

    def _retry_later(self, path: Path) -> None:
        _, last = self._backoff.get(path, (0.0, 0.0))
        delay = min(last * 2, self.retry_max) if last else self.retry_initial
        self._backoff[path] = (time.monotonic() + delay, delay)

    def _register(self, path: Path, identity: Identity, generation: int) -> None:
        """One registration attempt, as operation_generator.go does it (runs unlocked)."""
        channel = grpc.insecure_channel(f"unix:{path}")
        live: _Live | None = None
        try:
            info = self._get_info(channel, path)
            if info is None:
                return
            try:
                live = self._admit(path, identity, generation, info, channel)
            except _Refused as refusal:
                self._notify(channel, registered=False, error=str(refusal))
                with self._changed:
                    self.refusals.append(
                        Refusal(path, info.type, info.name, str(refusal), time.monotonic())
                    )
                    self._retry_later(path)
                    self._changed.notify_all()
                return
            if live is not None:
                self._notify(channel, registered=True, error="")
                # Recorded once the plugin has been told, so a test that saw the registration
                # can rely on the plugin knowing too.
                with self._changed:
                    self.registrations.append(live.registration)
        finally:
            if live is None:
                channel.close()
            with self._changed:
                self._pending.discard(path)
                self._changed.notify_all()

    def _get_info(self, channel: grpc.Channel, path: Path) -> reg_pb2.PluginInfo | None:
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
            info: reg_pb2.PluginInfo = reg_grpc.RegistrationStub(channel).GetInfo(
                reg_pb2.InfoRequest(), timeout=self.info_timeout
            )
        except (grpc.FutureTimeoutError, grpc.RpcError) as error:
            with self._changed:
                self.failures.append(f"{path.name}: dial or GetInfo failed: {error!r}")
                self._retry_later(path)
            return None
        return info

    def _admit(
        self,
        path: Path,
        identity: Identity,
        generation: int,
        info: reg_pb2.PluginInfo,
        channel: grpc.Channel,
    ) -> _Live | None:
        """Validate and register, or raise _Refused; None when the kubelet moved on meanwhile."""
        if info.type != PLUGIN_TYPE:
            raise _Refused(f"no handler registered for plugin type: {info.type} at socket {path}")
        endpoint = info.endpoint or str(path)
        try:
            service = choose_service(info.supported_versions, self.services)
        except ValueError as error:
            raise _Refused(
                f"invalid supported gRPC versions of DRA driver plugin {info.name} "
                f"at endpoint {endpoint}: {error}"
            ) from None
        if self.check_endpoint and not _is_socket(Path(endpoint)):
            raise _Refused(f"endpoint {endpoint} of DRA driver plugin {info.name} is not a socket")
        registration = Registration(
            info.name,
            endpoint,
            path,
            tuple(info.supported_versions),
            service,
            time.monotonic(),
            pick_health_service(info.supported_versions, self.health_services),
        )
        with self._changed:
            if generation != self._generation or self._desired.get(path) != identity:
                return None
            if any(
                p.registration.driver == info.name and p.registration.endpoint == endpoint
                for p in self._live.values()
            ):
                raise _Refused(
                    f"endpoint {endpoint} already registered for DRA driver plugin {info.name}"
                )
            live = _Live(registration, identity, channel, grpc.insecure_channel(f"unix:{endpoint}"))
            live.health = self._health_stream(registration, live.dra_channel)
            self._live[path] = live
            self._backoff.pop(path, None)
            self._wipes_due.pop(info.name, None)
        if live.health is not None:
            live.health.start()
        if self.info_poll_interval is not None:
            threading.Thread(
                target=self._poll, args=(path, live), name="dra-kubelet-poll", daemon=True
            ).start()
        return live

    def _health_stream(
        self, registration: Registration, channel: grpc.Channel
    ) -> HealthStream | None:
        if registration.health_service is None:
            return None
        messages, stubs = HEALTH_SERVICES[registration.health_service]
        driver = registration.driver

        def receive(response: object) -> None:
            with self._changed:
                now = time.monotonic()
                known = self._health.get(driver, {})
                reported = read_health_response(response, now)
                self._health[driver] = reconcile_health(known, reported, now)
                self._changed.notify_all()

        def note(event: str) -> None:
            with self._changed:
                self.health_events.append((driver, event, time.monotonic()))
                self._changed.notify_all()

        return HealthStream(
            channel, messages, stubs, receive=receive, note=note, retry=self.health_retry
        )

    def _notify(self, channel: grpc.Channel, *, registered: bool, error: str) -> None:
        status = reg_pb2.RegistrationStatus(plugin_registered=registered, error=error)
        try:
            reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(status, timeout=5)
        except grpc.RpcError as rpc_error:
            with self._changed:
                self.failures.append(f"NotifyRegistrationStatus failed: {rpc_error!r}")

    def _poll(self, path: Path, live: _Live) -> None:
        """monitor.go: GetInfo every interval; deregister after max_poll_failures in a row."""
        assert self.info_poll_interval is not None
        stub = reg_grpc.RegistrationStub(live.info_channel)
        failures = 0
        while not live.stop_polling.wait(self.info_poll_interval):
            try:
                stub.GetInfo(reg_pb2.InfoRequest(), timeout=self.poll_timeout)
            except grpc.RpcError as error:
                failures += 1
                reason = f"GetInfo failed {failures} times in a row: {error.code()}"
            else:
                failures = 0
            if failures >= self.max_poll_failures:
                break
        else:
            return
        with self._changed:
            if self._live.get(path) is not live:
                return
            self._deregister(path, reason)
            self._desired.pop(path, None)
            self._silent[path] = (live.identity, time.monotonic() + self.info_poll_interval)
        live.close()

    def _probe(self, path: Path, identity: Identity, generation: int) -> None:
        """A silent plugin's socket that answers GetInfo again is registered again."""
        assert self.info_poll_interval is not None
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            reg_grpc.RegistrationStub(channel).GetInfo(
                reg_pb2.InfoRequest(), timeout=self.poll_timeout
            )
            answered = True
        except grpc.RpcError:
            answered = False
        finally:
            channel.close()
        with self._changed:
            self._pending.discard(path)
            if generation != self._generation or path not in self._silent:
                return
            if answered:
                del self._silent[path]
                self._desired[path] = identity
            else:
                self._silent[path] = (identity, time.monotonic() + self.info_poll_interval)
            self._changed.notify_all()


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False
